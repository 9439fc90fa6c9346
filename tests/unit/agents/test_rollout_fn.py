"""rLLM-style rollout functions (fully_async/agents/rollout_fn.py) against a scripted engine client: OpenAI-shaped
chat calls over an exact token list, history edits split into rows, limits, partial rollout off, config."""

from __future__ import annotations

import asyncio
import json

import pytest

from fully_async.agents import Sample
from fully_async.agents.rollout_fn import EpisodeOver, RolloutFnAgentLoop
from fully_async.config import ConfigError, MultiTurnConfig, compose
from fully_async.data import PromptRow
from fully_async.engines import Sampling
from fully_async.metrics import batch_metrics
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import NO_VERSION, PromptRef, TrajectoryGroup
from tests import fakes


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def sample():
    return Sample(PromptRef(0, 3), 1, PromptRow("t", [{"role": "user", "content": "go"}], "7"))


def run(tok, fn, turns, response_length=400, continue_on_abort=True, versions=None, before_turn=None, **cfg):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    client = fakes.ScriptedClient(tok, turns, end=end, versions=versions, before_turn=before_turn)
    loop = RolloutFnAgentLoop(tok, Sampling(), response_length, continue_on_abort, MultiTurnConfig(**cfg), fn)
    out = asyncio.run(loop.run(client, sample()))
    return loop, client, out


CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'


async def tool_episode(client, tokenizer, messages, ground_truth, **_):
    """Call the model, answer its tool call, call it again: the conversation only grows."""
    reply = await client.chat(messages)
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "A=" + ground_truth}]
    final = await client.chat(messages)
    return final["content"].upper()


def test_a_growing_conversation_is_one_exact_token_row(tok):
    loop, client, t = run(tok, tool_episode, [CALL, "answer"])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    turn1, turn2 = tok.encode(CALL) + [im_end], tok.encode("answer") + [im_end]
    inserted = tok.encode("\n<|im_start|>tool\nA=7<|im_end|>\n<|im_start|>assistant\n")
    assert t.response_ids.tolist() == turn1 + inserted + turn2
    assert t.loss_mask.tolist() == [1] * len(turn1) + [0] * len(inserted) + [1] * len(turn2)
    assert (t.token_versions[t.loss_mask == 0] == NO_VERSION).all()
    # The second call was sent the exact tokens so far (the model's call was not re-rendered from the message).
    assert client.prompts[1] == t.prompt_ids.tolist() + t.response_ids.tolist()[: -len(turn2)]
    assert t.reward_info["turns"] == 2 and t.reward_info["tool_calls"] == 1 and t.reward_info["split_rows"] == 1
    assert loop.reward_text(t) == "ANSWER"  # the function's return value is what the reward sees


def test_the_assistant_message_is_openai_shaped(tok):
    seen = []

    async def fn(client, tokenizer, messages, **_):
        seen.append(await client.chat(messages))
        seen.append(await client.chat([*messages, seen[0], {"role": "tool", "content": "x"}]))

    loop, _, t = run(tok, fn, ["let me look " + CALL, "<tool_call>{oops</tool_call>"])
    call = seen[0]["tool_calls"][0]
    assert seen[0]["role"] == "assistant" and seen[0]["content"] == "let me look"
    assert call["type"] == "function" and call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"key": "a"}
    assert "tool_calls" not in seen[1] and seen[1]["content"] == "<tool_call>{oops</tool_call>"
    assert t.reward_info["tool_errors/malformed"] == 1 and t.reward_info["tool_error"] is True
    assert loop.reward_text(t) == seen[1]["content"]  # no return value: the last assistant content


async def editing_episode(client, tokenizer, messages, **_):
    """Call, then drop the model's turn and ask afresh (a history edit), then continue that conversation."""
    first = await client.chat(messages)
    edited = [{"role": "user", "content": f"summary: {first['content']}. go on"}]
    second = await client.chat(edited)
    await client.chat([*edited, second, {"role": "user", "content": "more"}])
    return "done"


def test_a_history_edit_splits_the_sample_into_rows_that_share_its_reward(tok):
    loop, client, rows = run(tok, editing_episode, ["one", "two", "three"])
    assert isinstance(rows, list) and len(rows) == 2
    first, second = rows
    assert first.response_ids.tolist() == tok.encode("one") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert first.loss_mask.tolist() == [1] * len(first.response_ids)
    # The second row starts from the edited chat rendered afresh and then grows token-exactly.
    edited = [{"role": "user", "content": "summary: one. go on"}]
    assert second.prompt_ids.tolist() == loop.chat.render_ids(edited, add_generation_prompt=True)
    assert (
        client.prompts[2] == second.prompt_ids.tolist() + second.response_ids.tolist()[: -len(tok.encode("three")) - 1]
    )
    assert [r.reward_info["split_part"] for r in rows] == [0, 1] and second.reward_info["split_rows"] == 2
    assert "turns" not in first.reward_info and second.reward_info["turns"] == 3
    group = TrajectoryGroup(PromptRef(0, 3), rows)
    assert batch_metrics([group], 0)["agent/split_rows"] == 1.0


def test_limits_end_the_episode_and_keep_what_was_generated(tok):
    async def chatty(client, tokenizer, messages, **_):
        while True:
            reply = await client.chat(messages)
            messages = [*messages, reply, {"role": "user", "content": "again"}]

    _, client, t = run(tok, chatty, ["a", "b", "c", "d"], max_turns=3)
    assert len(client.prompts) == 3 and t.reward_info["turns"] == 3 and t.finish_reason == "length"
    _, client, t = run(tok, chatty, ["a" * 30] * 4, response_length=40)
    assert t.response_length <= 40 and t.finish_reason == "length" and len(client.prompts) == 1

    async def catches(client, tokenizer, messages, **_):
        with pytest.raises(EpisodeOver, match="max_turns=1"):
            await client.chat(messages)
            await client.chat(messages)
        return "caught"

    loop, _, t = run(tok, catches, ["a", "b"], max_turns=1)
    assert loop.reward_text(t) == "caught"


def test_partial_rollout_off_restarts_the_function_when_versions_change(tok):
    calls = []

    async def fn(client, tokenizer, messages, **_):
        calls.append(1)
        try:
            a = await client.chat(messages)
            await client.chat([*messages, a, {"role": "user", "content": "next"}])
        except Exception:  # a user's broad except must not swallow the restart
            return "swallowed"

    # Turn 1 under v0, turn 2 under v1: the episode restarts; its second attempt gets turns 3 and 4 under v1.
    _, client, t = run(tok, fn, ["a", "b", "c", "d"], continue_on_abort=False, versions=[0, 1, 1, 1])
    assert len(calls) == 2 and t.reward_info["restarts"] == 1
    assert set(t.token_versions[t.loss_mask == 1].tolist()) == {1}


def test_rollout_fn_config():
    cfg = compose(["rollout.rollout_fn=tests.unit.agents.test_rollout_fn:tool_episode"])
    assert cfg.rollout.agent_loop_path() == "fully_async.agents.rollout_fn:RolloutFnAgentLoop"
    with pytest.raises(ConfigError, match="rollout.rollout_fn and rollout.agent_loop"):
        compose(["rollout.rollout_fn=a.b:c", "rollout.agent_loop=fully_async.agents.tool:ToolAgentLoop"])
    with pytest.raises(ConfigError, match="rollout.rollout_fn must be a dotted path"):
        compose(["rollout.rollout_fn=nodots"])
    with pytest.raises(TypeError, match="must be an async function"):
        RolloutFnAgentLoop(None, Sampling(), 8, rollout_fn=lambda client, tokenizer: None)
