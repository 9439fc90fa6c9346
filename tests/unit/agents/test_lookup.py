"""The built-in tool task `lookup` (fully_async/agents/lookup.py): a one-letter turn calls the lookup tool, whose
answer (the row's hidden digit) is appended token-exactly as a tool turn; a digit answers; the reward sees the last
turn; tool use is counted per trajectory and per step (agent/tool_call_ratio)."""

from __future__ import annotations

import asyncio

import pytest

from fully_async.agents import Sample
from fully_async.agents.lookup import LookupAgentLoop, call_of
from fully_async.config import ConfigError, MultiTurnConfig, compose
from fully_async.config.sections import LOOKUP_LOOP
from fully_async.data import LOOKUP_PROMPT, synthetic_rows
from fully_async.engines import Sampling
from fully_async.metrics import _agent_metrics
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import PromptRef
from fully_async.reward.rule import synthetic_score
from tests import fakes


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def play(tok, digit, turns, delay=(0.0, 0.0)):
    rows = synthetic_rows(60, 0, "train", "lookup", env_delay_s=delay)
    row = next(r for r in rows if r.ground_truth == str(digit))
    loop = LookupAgentLoop(tok, Sampling(), 64, multi_turn=MultiTurnConfig(max_turns=2, max_tokens_per_turn=1))
    client = fakes.ScriptedClient(tok, turns)  # one token per turn: the end-of-turn token is inserted
    t = asyncio.run(loop.run(client, Sample(PromptRef(0, 0), 0, row)))
    return loop, client, t


def test_a_letter_calls_the_tool_whose_answer_is_the_next_turns_observation(tok):
    loop, client, t = play(tok, 6, ["q", "6", "never"])
    text = tok.decode(t.response_ids.tolist())
    assert text == "q<|im_end|>\n<|im_start|>tool\n6666666666<|im_end|>\n<|im_start|>assistant\n6"
    assert t.loss_mask.sum() == 2 and t.reward_info["tool_calls"] == 1 and t.reward_info["turns"] == 2
    assert t.reward_info["tool_errors"] == 0 and t.reward_info["env_turns"] == 0
    # token-exact: the second turn continued from the very ids the first turn and the tool turn left
    assert client.prompts[1] == t.prompt_ids.tolist() + t.response_ids.tolist()[:-1]
    assert loop.reward_text(t) == "6" and synthetic_score("x", "6", "6")["score"] == 1.0
    assert loop._records == {}  # the episode's record is dropped when it ends


def test_a_digit_answers_at_once_and_anything_else_ends_unanswered(tok):
    loop, client, t = play(tok, 4, ["7", "never"])
    assert t.reward_info["turns"] == 1 and t.reward_info["tool_calls"] == 0 and len(client.prompts) == 1
    assert loop.reward_text(t) == "7" and synthetic_score("x", "7", "4")["score"] == 0.0
    loop, client, t = play(tok, 4, ["?", "4"])
    assert t.reward_info["turns"] == 1 and t.reward_info["tool_calls"] == 0 and loop.reward_text(t) == "?"
    loop, client, t = play(tok, 4, ["Z", "k"])  # a call on the last turn is not run: no answer, reward 0
    assert t.reward_info["tool_calls"] == 1 and t.reward_info["max_turns_reached"] and loop.reward_text(t) == "k"


def test_the_tool_answers_after_its_delay(tok):
    _, _, t = play(tok, 9, ["a", "9"], delay=(0.05, 0.08))
    assert 0.05 <= t.timings["tool_s"] < 0.5


def test_call_format_rows_config_and_the_tool_call_ratio(tok):
    assert [c and c.arguments for c in map(call_of, ["a", " K", "7", "?", "", "é"])] == [
        {"query": "a"},
        {"query": "K"},
        None,
        None,
        None,
        None,
    ]
    rows = synthetic_rows(200, 1, "train", "lookup")
    assert {r.messages[0]["content"] for r in rows} == {LOOKUP_PROMPT}
    assert {r.ground_truth for r in rows} == {str(d) for d in range(10)}
    cfg = compose(["task=lookup"])
    assert cfg.agent_loop_path() == LOOKUP_LOOP and cfg.rollout.multi_turn.max_turns == 2
    with pytest.raises(ConfigError, match="max_turns must be >= 2 for data.synthetic_task=lookup"):
        compose(["task=lookup", "rollout.multi_turn.max_turns=1"])
    trajs = [play(tok, 3, turns)[2] for turns in (["b", "3"], ["3"], ["x", "1"], ["!"])]
    metrics = _agent_metrics(trajs)
    assert metrics["agent/tool_call_ratio"] == 0.5 and metrics["agent/tool_calls/mean"] == 0.5
