"""The built-in multi-turn `guess` task (fully_async/agents/guess.py): the environment's answer (the digit) is inserted
as a user turn, a right guess ends the episode, the reward sees the last guess, the answer's delay is waited for."""

from __future__ import annotations

import asyncio

import pytest

from fully_async.agents import Sample
from fully_async.agents.guess import GuessAgentLoop, answer, guess_of
from fully_async.config import MultiTurnConfig, compose
from fully_async.config.sections import GUESS_LOOP
from fully_async.data import GUESS_PROMPT, synthetic_rows
from fully_async.engines import Sampling
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


def play(tok, digit, guesses, delay=(0.0, 0.0), max_turns=2):
    row = synthetic_rows(40, 0, "train", "guess", env_delay_s=delay)
    row = next(r for r in row if r.ground_truth == str(digit))
    loop = GuessAgentLoop(tok, Sampling(), 200, multi_turn=MultiTurnConfig(max_turns=max_turns, max_tokens_per_turn=1))
    client = fakes.ScriptedClient(tok, guesses)  # one token per turn: the end-of-turn token is inserted
    t = asyncio.run(loop.run(client, Sample(PromptRef(0, 0), 0, row)))
    return loop, client, t


def test_the_second_guess_can_repeat_the_digit_the_environment_told(tok):
    loop, client, t = play(tok, 8, ["5", "8", "never"])
    text = tok.decode(t.response_ids.tolist())
    assert text == "5<|im_end|>\n<|im_start|>user\nno, it is 88888<|im_end|>\n<|im_start|>assistant\n8"
    assert t.loss_mask.sum() == 2 and t.reward_info["env_turns"] == 1 and t.reward_info["turns"] == 2
    assert len(client.prompts) == 2 and client.prompts[1] == t.prompt_ids.tolist() + t.response_ids.tolist()[:-1]
    assert loop.reward_text(t) == "8" and synthetic_score("x", "8", "8")["score"] == 1.0
    _, client, t = play(tok, 2, ["2", "never"])  # right at once: one turn
    assert t.reward_info["turns"] == 1 and len(client.prompts) == 1


def test_a_digit_not_found_within_max_turns_scores_zero(tok):
    loop, client, t = play(tok, 3, ["x", "5", "9"], max_turns=3)
    text = tok.decode(t.response_ids.tolist())
    assert text.count("no, it is 33333") == 2
    assert t.reward_info["turns"] == 3 and t.reward_info["env_turns"] == 2 and len(client.prompts) == 3
    assert loop.reward_text(t) == "9" and synthetic_score("x", "9", "3")["score"] == 0.0


def test_the_environment_answers_after_its_delay(tok):
    _, _, t = play(tok, 9, ["1", "2", "9"], delay=(0.05, 0.08), max_turns=3)
    assert 0.1 <= t.timings["env_s"] < 0.5


def test_answers_rows_and_config():
    assert [answer(g, 4) for g in (None, 2, 4)] == ["no, it is 44444", "no, it is 44444", None]
    assert guess_of(" 7x") == 7 and guess_of("<|im_end|>") is None and guess_of("") is None
    rows = synthetic_rows(200, 1, "train", "guess", env_delay_s=(0.05, 0.5))
    assert {r.messages[0]["content"] for r in rows} == {GUESS_PROMPT}
    assert {r.ground_truth for r in rows} == {str(d) for d in range(10)}
    assert rows[0].extra_info["env_delay_s"] == [0.05, 0.5]
    assert compose(["data.synthetic_task=guess"]).agent_loop_path() == GUESS_LOOP
    other = compose(["data.synthetic_task=guess", "rollout.agent_loop=fully_async.agents.tool:ToolAgentLoop"])
    assert other.agent_loop_path() == "fully_async.agents.tool:ToolAgentLoop"
    assert compose([]).agent_loop_path() == "fully_async.agents.single_turn:SingleTurnAgentLoop"
