"""VerifiersAgentLoop against a real installed verifiers (v1) environment (examples/verifiers_digits, package
fa-vf-digits: its taskset, its Env.run protocol, its @vf.reward rubric); the engine is the scripted client of
tests/fakes.py (the edge), so the episode's text, and hence the rubric's verdict, is known. Its rows as our dataset;
a two-turn episode token by token with the rubric's reward; an infrastructure failure inside the environment
restarts the episode and keeps the true reward; past the budget InfraExhausted (production re-issues the group,
tests/unit/test_production.py); an engine error is never taken for the environment's."""

from __future__ import annotations

import aiohttp
import pytest

from fully_async.agents import Sample
from fully_async.config import EnvConfig, MultiTurnConfig
from fully_async.data import load_rows
from fully_async.engines import Sampling
from fully_async.envs import verifiers_env
from fully_async.envs.failures import InfraExhausted
from fully_async.envs.reward import env_reward
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import NO_VERSION, PromptRef
from tests import fakes

NAME = "fa-vf-digits"
pytestmark = [pytest.mark.needs_extra("envs"), pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf") / "rows.jsonl"
    assert verifiers_env.write_rows(NAME, str(path), limit=12) == 12
    return load_rows([str(path)])


def sample(rows, i):
    return Sample(PromptRef(0, 5), 1, rows[i])


def agent(tok, retries=2):
    mt = MultiTurnConfig(max_turns=3, env=EnvConfig(infra_retries=retries))
    return verifiers_env.VerifiersAgentLoop(tok, Sampling(), 200, multi_turn=mt)


def im_end(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


def test_the_taskset_becomes_dataset_rows(rows):
    assert len(rows) == 12
    assert rows[3].messages == [{"role": "user", "content": "Reply with the digit 3."}]
    assert rows[3].ground_truth == "3"
    assert rows[3].extra_info == {"vf_env": NAME, "vf_idx": 3}


async def test_two_turn_episode_is_token_exact_and_scored_by_the_rubric(tok, rows):
    client = fakes.ScriptedClient(tok, ["7", "3"], end=im_end(tok))
    loop = agent(tok)
    t = await loop.run(client, sample(rows, 3))
    turn = [tok.encode("7")[0], im_end(tok)]
    feedback = loop.chat.boundary(im_end(tok)) + loop.chat.delta([{"role": "user", "content": "Wrong, try again."}])
    assert t.response_ids.tolist() == turn + feedback + [tok.encode("3")[0], im_end(tok)]
    assert t.loss_mask.tolist() == [1, 1] + [0] * len(feedback) + [1, 1]
    assert (t.token_versions[t.loss_mask == 0] == NO_VERSION).all()
    assert client.prompts[1] == client.prompts[0] + turn + feedback  # the model continued from the exact tokens
    assert "Reply with the digit 3." in tok.decode(client.prompts[0])
    assert t.reward_info["env_reward"] == 0.5 and t.reward_info["vf/correct"] == 0.5  # right on the second try
    assert t.reward_info["turns"] == 2 and t.reward_info["env_retries"] == 0
    meta = loop.reward_meta(t, rows[3])
    assert (await env_reward(**{k: meta[k] for k in ("data_source", "ground_truth", "extra_info")}, solution_str=""))[
        "score"
    ] == 0.5


async def test_the_environments_protocol_ends_the_episode(tok, rows):
    client = fakes.ScriptedClient(tok, ["4", "9", "9"], end=im_end(tok))
    t = await agent(tok).run(client, sample(rows, 4))
    assert len(client.prompts) == 1 and t.reward_info["env_reward"] == 1.0  # right at once: no second turn


class _Flaky:
    """The real environment whose `run` first fails `failures` times with a reset connection mid-episode (after
    the model's first turn), as a dead sandbox or tool server would."""

    def __init__(self, env, failures, error=aiohttp.ServerDisconnectedError):
        self.env, self.failures, self.calls, self.error = env, failures, 0, error

    async def setup(self, agents):
        await self.env.setup(agents)

    async def run(self, task, agents):
        self.calls += 1
        if self.calls <= self.failures:
            async with agents.solver.interaction(task) as chat:
                await chat.turn()
            raise self.error()
        await self.env.run(task, agents)


@pytest.fixture
def flaky(monkeypatch):
    env, tasks = verifiers_env.load(NAME)

    def make(failures, error=aiohttp.ServerDisconnectedError):
        f = _Flaky(env, failures, error)
        monkeypatch.setitem(verifiers_env._ENVS, NAME, (f, tasks))
        return f

    return make


def _sandbox_error():
    import verifiers.v1 as vf

    return vf.SandboxError("sandbox lost")


@pytest.mark.parametrize("error", [aiohttp.ServerDisconnectedError, _sandbox_error], ids=["reset", "sandbox"])
async def test_an_infrastructure_failure_restarts_the_episode_and_keeps_the_true_reward(tok, rows, flaky, error):
    f = flaky(1, error)
    client = fakes.ScriptedClient(tok, ["5", "5"], end=im_end(tok))
    t = await agent(tok).run(client, sample(rows, 5))
    assert f.calls == 2
    assert t.reward_info["env_reward"] == 1.0  # the retried episode's own reward, not a fake 0
    assert t.reward_info["env_retries"] == 1 and t.reward_info["env_infra/reset"] == 1
    assert t.response_ids.tolist() == [tok.encode("5")[0], im_end(tok)]  # the broken attempt is not in it


async def test_past_the_budget_the_sample_raises_for_reissue(tok, rows, flaky):
    flaky(5)
    loop = agent(tok, retries=1)
    with pytest.raises(InfraExhausted):
        await loop.run(fakes.ScriptedClient(tok, ["5"] * 4, end=im_end(tok)), sample(rows, 5))
    assert loop.counts["env_exhausted"] == 1 and loop.counts["env_infra_failures"] == 2


class _BrokenEngine:
    async def generate(self, *a, **k):
        raise aiohttp.ClientConnectionError("engine down")


async def test_an_engine_error_is_not_the_environments(tok, rows):
    loop = agent(tok)
    with pytest.raises(aiohttp.ClientConnectionError, match="engine down"):
        await loop.run(_BrokenEngine(), sample(rows, 1))
    assert loop.counts["env_infra_failures"] == 0


@pytest.mark.long
@pytest.mark.timeout(3000)
def test_the_verifiers_example_trains_50_steps_with_rewards_that_vary(tmp_path):
    """The whole job on the real engine and trainer (examples/verifiers_digits/run.sh, 50 steps): every step is
    scored by the environment's rubric, the rewards are not constant, and every prompt is trained once."""
    import json
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        ["bash", "examples/verifiers_digits/run.sh", "trainer.total_steps=50", "engine.startup_timeout_s=1200",
         f"hydra.run.dir={tmp_path}", "logger=[jsonl]"],
        cwd=repo, env={**os.environ, "FULLY_ASYNC_SKIP_ENGINE": "1"}, capture_output=True, text=True, timeout=2900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    trajs = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines() if line]
    assert len({t["step"] for t in trajs}) == 50
    assert len({t["reward"] for t in trajs}) > 1  # not constant
    steps_of: dict[str, set[int]] = {}
    for t in trajs:
        steps_of.setdefault(t["prompt_uid"], set()).add(t["step"])
    assert all(len(s) == 1 for s in steps_of.values())  # no prompt trained at two steps
