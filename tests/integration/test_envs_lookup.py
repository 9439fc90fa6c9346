"""The lookup tool task behind a real OpenEnv server process (fully_async/envs/lookup_env.py, launched by the pool on
127.0.0.1), driven by OpenEnvAgentLoop; the engine is the scripted client of tests/fakes.py (the edge), so the
episode's text, and hence the environment's verdict, is known: the task the failure-rate sweep learns on."""

from __future__ import annotations

import pytest
import pytest_asyncio

from fully_async.agents import Sample
from fully_async.config import EnvConfig, MultiTurnConfig
from fully_async.data import LOOKUP_PROMPT, PromptRow
from fully_async.engines import Sampling
from fully_async.envs.openenv import OpenEnvAgentLoop
from fully_async.envs.pool import EnvServerPool
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import PromptRef
from tests import fakes

pytestmark = [pytest.mark.needs_extra("envs"), pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

APP = "fully_async.envs.lookup_env:app"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tmp_path_factory):
    pool = EnvServerPool(EnvConfig(app=APP, servers=1, call_timeout_s=10.0), tmp_path_factory.mktemp("envs"))
    await pool.start()
    yield pool
    await pool.stop()


def sample(digit="3"):
    return Sample(PromptRef(0, 2), 0, PromptRow("t", [{"role": "user", "content": LOOKUP_PROMPT}], digit))


async def episode(tok, pool, turns, digit="3", max_turns=2, response_length=64):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns_cfg = MultiTurnConfig(max_turns=max_turns, max_tokens_per_turn=1)
    loop = OpenEnvAgentLoop(tok, Sampling(), response_length, multi_turn=turns_cfg, pool=pool)
    client = fakes.ScriptedClient(tok, turns, end=end)
    return loop, client, await loop.run(client, sample(digit))


async def test_a_letter_calls_the_served_tool_whose_answer_the_model_copies(tok, pool):
    loop, client, t = await episode(tok, pool, ["k", "3"])
    answer = loop.chat.boundary(t.response_ids[0]) + loop.chat.delta([{"role": "user", "content": "3" * 10}])
    assert client.prompts[1] == client.prompts[0] + [tok.encode("k")[0]] + answer  # the tool's answer, token-exact
    assert tok.decode(client.prompts[0]).count(LOOKUP_PROMPT) == 1  # the reset adds no turn: the row's prompt only
    assert t.reward_info["env_reward"] == 1.0 and t.reward_info["env_turns"] == 1
    assert t.loss_mask.tolist() == [1] + [0] * len(answer) + [1]


@pytest.mark.parametrize(
    ("turns", "reward", "env_turns"),
    [
        (["3"], 1.0, 0),  # a right guess without the tool
        (["5"], 0.0, 0),  # a wrong guess
        (["k", "5"], 0.0, 1),  # told, then answered wrong
        (["k", "q"], 0.0, 1),  # a second call is not an answer
        (["?"], 0.0, 0),  # neither a letter nor a digit: unanswered
    ],
)
async def test_the_environments_verdict(tok, pool, turns, reward, env_turns):
    # A third turn and room for it: the environment's `done` ends each episode, not the loop's caps (a third model
    # call would find the scripted client out of turns).
    _, _, t = await episode(tok, pool, turns, max_turns=3, response_length=400)
    assert (t.reward_info["env_reward"], t.reward_info["env_turns"]) == (reward, env_turns)
    assert t.reward_info["turns"] == len(turns)
