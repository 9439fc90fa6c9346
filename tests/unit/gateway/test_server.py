"""The gateway's HTTP server (fully_async/gateway/server.py, shapes.py) on 127.0.0.1 with one session around a
ChatClient on a scripted engine: the session key is required, what cannot be served token-exactly is refused,
completions over token ids extend the recorded row exactly, a stream carries the same turn as chunks."""

from __future__ import annotations

import json

import aiohttp
import pytest

from fully_async.agents.rollout_fn import ChatClient, RolloutFnAgentLoop
from fully_async.config import MultiTurnConfig
from fully_async.engines import Sampling
from fully_async.gateway.server import GatewayServer
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import NO_VERSION
from tests import fakes


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


async def _unused(*a, **k):
    return None


async def serve(tok, turns, max_turns=4):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = fakes.ScriptedClient(tok, turns, end=end)
    loop = RolloutFnAgentLoop(tok, Sampling(), 400, True, MultiTurnConfig(max_turns=max_turns), _unused)
    server = await GatewayServer(tok).start()
    session = server.open(ChatClient(loop, engine))
    return server, session, engine


async def post(session, path, body, key=None, raw=False):
    headers = {"Authorization": f"Bearer {key or session.key}"}
    async with aiohttp.ClientSession() as http, http.post(session.base_url + path, json=body, headers=headers) as r:
        return r.status, (await r.text() if raw else await r.json())


GO = [{"role": "user", "content": "go"}]


async def test_the_session_key_is_required_and_a_closed_session_is_gone(tok):
    server, session, engine = await serve(tok, ["a"])
    try:
        status, body = await post(session, "/chat/completions", {"model": "x", "messages": GO}, key="wrong")
        assert status == 401 and body["error"]["code"] == "invalid_api_key" and engine.prompts == []
        auth = {"Authorization": f"Bearer {session.key}"}
        async with aiohttp.ClientSession() as http, http.get(session.base_url + "/models", headers=auth) as r:
            assert (await r.json())["data"][0]["id"] == "policy"
        server.close(session)
        status, body = await post(session, "/chat/completions", {"model": "x", "messages": GO})
        assert status == 404 and body["error"]["code"] == "session_not_found"
    finally:
        await server.stop()


async def test_what_cannot_be_served_exactly_is_refused_or_counted(tok):
    server, session, engine = await serve(tok, ["a", "b"])
    try:
        status, body = await post(session, "/chat/completions", {"messages": GO, "n": 2})
        assert status == 400 and body["error"]["param"] == "n"
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        status, body = await post(session, "/chat/completions", {"messages": image})
        assert status == 400 and "image_url" in body["error"]["message"]
        status, body = await post(session, "/completions", {"prompt": ["a", "b"]})
        assert status == 400 and body["error"]["param"] == "prompt"
        assert engine.prompts == []  # nothing refused reached the engine
        status, body = await post(
            session, "/chat/completions", {"messages": GO, "stop": ["x"], "tool_choice": "required"}
        )
        assert status == 200 and dict(session.ignored) == {"stop": 1, "tool_choice": 1}
        parts = [{"type": "text", "text": "g"}, {"type": "text", "text": "o"}]
        status, body = await post(session, "/chat/completions", {"messages": [{"role": "user", "content": parts}]})
        assert status == 200 and engine.prompts[1] == engine.prompts[0]  # text parts are the same prompt as "go"
    finally:
        await server.stop()


async def test_completions_over_token_ids_extend_the_row_exactly_and_report_logprobs(tok):
    server, session, engine = await serve(tok, ["ab", "cd"])
    try:
        prompt = tok.encode("hello")
        status, body = await post(session, "/completions", {"prompt": prompt, "max_tokens": 8, "logprobs": 1})
        first = tok.encode("ab") + [tok.convert_tokens_to_ids("<|im_end|>")]
        assert status == 200 and body["choices"][0]["text"] == "ab" and body["usage"]["completion_tokens"] == 3
        assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
        more = tok.encode(" more")
        status, body = await post(session, "/completions", {"prompt": prompt + first + more})
        tr = session.chat.transcript
        assert tr.ids == prompt + first + more + tok.encode("cd") + [first[-1]]
        assert tr.mask == [1] * 3 + [0] * len(more) + [1] * 3 and NO_VERSION in tr.versions
        assert session.chat.rows == []  # one row: the second prompt extended the first exactly
    finally:
        await server.stop()


async def test_a_stream_carries_the_turn_as_chunks_with_openai_tool_calls(tok):
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    server, session, _ = await serve(tok, [call])
    try:
        body = {"messages": GO, "stream": True, "stream_options": {"include_usage": True}}
        status, text = await post(session, "/chat/completions", body, raw=True)
        events = [line[len("data: ") :] for line in text.split("\n\n") if line]
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        delta_calls = [
            c["choices"][0]["delta"]["tool_calls"]
            for c in chunks
            if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
        ]
        fn = delta_calls[0][0]["function"]
        assert fn["name"] == "f" and json.loads(fn["arguments"]) == {"x": 1} and delta_calls[0][0]["index"] == 0
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
        assert chunks[-1]["usage"]["completion_tokens"] == len(tok.encode(call)) + 1
    finally:
        await server.stop()


async def test_a_limit_answers_an_openai_error_and_marks_the_session_over(tok):
    server, session, engine = await serve(tok, ["a", "b"], max_turns=1)
    try:
        assert (await post(session, "/chat/completions", {"messages": GO}))[0] == 200
        status, body = await post(session, "/chat/completions", {"messages": GO})
        assert status == 400 and body["error"]["code"] == "max_turns_exceeded" and session.over is not None
        assert len(engine.prompts) == 1 and not session.failed.done()
    finally:
        await server.stop()
