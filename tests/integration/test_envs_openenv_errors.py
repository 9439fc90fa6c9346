"""An error inside an OpenEnv environment is never a trained reward: OpenEnvAgentLoop against openenv-core's own server
(create_app, served in-process by uvicorn on 127.0.0.1) whose environment raises where the test asks it to. Each
error reply code meets the rule of fully_async/envs/failures.py (docs/environments.md's failure table): an exception
in step or reset (EXECUTION_ERROR), a server at its session limit (CAPACITY_REACHED), an environment that cannot be
built (FACTORY_ERROR) are infrastructure: the episode restarts on a fresh session, counted by kind, and keeps the
environment's true reward; an action the environment rejects (`raise rejected(...)`, VALIDATION_ERROR, or a validator's
ValueError, which openenv-core 0.3.0 answers as SESSION_ERROR) is the model's: the episode ends with the reward so
far; an action field the environment does not take is neither (EnvProtocolError). The engine is the scripted client of
tests/fakes.py (the edge)."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
import pytest_asyncio

from fully_async.agents import Sample
from fully_async.config import EnvConfig, MultiTurnConfig
from fully_async.data import PromptRow
from fully_async.engines import Sampling
from fully_async.engines.process import free_port
from fully_async.envs.failures import EnvProtocolError, InfraExhausted, rejected
from fully_async.envs.openenv import OpenEnvAgentLoop
from fully_async.envs.pool import EnvServerPool
from fully_async.metrics import batch_metrics
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import PromptRef, TrajectoryGroup
from tests import fakes

pytestmark = [
    pytest.mark.needs_extra("envs"),
    pytest.mark.timeout(180),
    pytest.mark.asyncio(loop_scope="module"),
]


class Faults:
    """What the served environments do wrong next (the servers run in this process): counts of the next resets and
    environment constructions that raise, and every environment built."""

    resets = 0
    inits = 0
    built = 0


def faulty_app(max_concurrent_envs: int):
    """An OpenEnv app: say the row's digit ("3": reward 1.0; "7": "Wrong, try again.", reward 0.25, one more turn).
    A step whose text opens with "b" raises RuntimeError (its database went away); "r" is rejected by the Action's
    validator with `rejected()`, "s" by step itself with `rejected()`; "v" meets a validator raising ValueError."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import field_validator

    class FaultyAction(Action):
        message: str = ""

        @field_validator("message")
        @classmethod
        def _valid(cls, text: str) -> str:
            if text.startswith("r"):
                raise rejected("an action must be a digit", text)
            if text.startswith("v"):
                raise ValueError("an action must be a digit")
            return text

    class FaultyObservation(Observation):
        message: str = ""

    class FaultyEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            if Faults.inits > 0:
                Faults.inits -= 1
                raise RuntimeError("the sandbox image is not there")
            Faults.built += 1
            self._state = State(episode_id="", step_count=0)
            self.target = ""

        def reset(self, seed=None, episode_id=None, ground_truth=None, **kwargs) -> FaultyObservation:
            if Faults.resets > 0:
                Faults.resets -= 1
                raise RuntimeError("the sandbox did not start")
            if ground_truth == "x":
                raise rejected("no task has the answer x")
            self._state = State(episode_id=episode_id or "", step_count=0)
            self.target = str(ground_truth)
            return FaultyObservation(message="Reply with the digit.", done=False, reward=0.0)

        def step(self, action, timeout_s=None, **kwargs) -> FaultyObservation:
            self._state.step_count += 1
            if action.message.startswith("b"):
                raise RuntimeError("the database connection dropped")
            if action.message.startswith("s"):
                raise rejected("no such digit", action.message)
            if action.message.startswith(self.target):
                return FaultyObservation(message="Right.", done=True, reward=1.0)
            return FaultyObservation(message="Wrong, try again.", done=self._state.step_count >= 2, reward=0.25)

        @property
        def state(self) -> State:
            return self._state

    return create_app(FaultyEnvironment, FaultyAction, FaultyObservation, env_name="faulty",
                      max_concurrent_envs=max_concurrent_envs)  # fmt: skip


class Served:
    """An ASGI app served by uvicorn in a thread of this process on 127.0.0.1."""

    def __init__(self, app) -> None:
        import uvicorn

        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=f"openenv {port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the in-process OpenEnv server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers():
    main, full = Served(faulty_app(8)), Served(faulty_app(1))
    yield {"main": main.url, "full": full.url}
    main.stop()
    full.stop()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest_asyncio.fixture(loop_scope="module")
async def pool_of(servers, tmp_path):
    """pool_of("full", "main"): a started pool of those servers, in that order (stopped after the test)."""
    pools = []

    async def make(*names):
        pool = EnvServerPool(EnvConfig(urls=[servers[n] for n in names], call_timeout_s=10.0, health_interval_s=0.5),
                             tmp_path)  # fmt: skip
        await pool.start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.stop()


def agent(tok, pool, retries=2, action_key="message"):
    env = EnvConfig(infra_retries=retries, call_timeout_s=10.0, health_interval_s=0.5, action_key=action_key)
    return OpenEnvAgentLoop(tok, Sampling(), 200, multi_turn=MultiTurnConfig(max_turns=3, env=env), pool=pool)


async def run(tok, loop, turns, answer="3"):
    client = fakes.ScriptedClient(tok, turns, end=tok.convert_tokens_to_ids("<|im_end|>"))
    row = PromptRow("t", [{"role": "user", "content": "digit?"}], answer)
    return await loop.run(client, Sample(PromptRef(0, 5), 1, row))


def infra(t) -> dict[str, int]:
    return {k: v for k, v in t.reward_info.items() if k.startswith("env_infra")}


async def test_an_exception_in_step_is_infrastructure_restarted_on_a_fresh_session_and_counted_by_kind(tok, pool_of):
    built = Faults.built
    t = await run(tok, agent(tok, await pool_of("main")), ["7", "b", "3"])
    assert "env_task_error" not in t.reward_info, "an exception inside the environment is not the model's"
    assert infra(t) == {"env_infra_failures": 1, "env_infra/execution": 1} and t.reward_info["env_retries"] == 1
    assert t.reward_info["env_reward"] == 1.0, "the retried episode keeps the environment's own reward"
    assert t.response_ids.tolist() == [tok.encode("3")[0], tok.convert_tokens_to_ids("<|im_end|>")]  # fresh attempt
    assert Faults.built == built + 2  # a fresh environment for the retry, not the broken one
    metrics = batch_metrics([TrajectoryGroup(t.prompt, [t])], trainer_version=0)
    assert metrics["env/infra/execution"] == 1.0 and metrics["env/infra_failures"] == 1.0


async def test_an_environment_that_keeps_raising_is_never_scored_past_the_retries(tok, pool_of):
    loop = agent(tok, await pool_of("main"), retries=1)
    with pytest.raises(InfraExhausted, match="2 attempts failed; last: execution: EXECUTION_ERROR during step"):
        await run(tok, loop, ["b", "b"])
    assert loop.counts["env_infra/execution"] == 2 and loop.counts["env_exhausted"] == 1


async def test_a_pool_stopped_right_after_a_failure_was_reported_stops(servers, tmp_path):
    pool = EnvServerPool(EnvConfig(urls=[servers["main"]], health_interval_s=0.5), tmp_path)
    await pool.start()
    await asyncio.sleep(0)  # the health checks wait for a suspect
    pool.suspect(servers["main"])  # as the last failed attempt of an episode does, then the run ends
    await asyncio.wait_for(pool.stop(), 10)  # Python 3.11's wait_for swallowed stop()'s cancel: it never returned


async def test_an_exception_in_reset_is_infrastructure(tok, pool_of):
    Faults.resets = 1
    t = await run(tok, agent(tok, await pool_of("main")), ["3"])
    assert infra(t) == {"env_infra_failures": 1, "env_infra/execution": 1} and t.reward_info["env_reward"] == 1.0


async def test_an_environment_that_cannot_be_built_is_infrastructure(tok, pool_of):
    Faults.inits = 1
    t = await run(tok, agent(tok, await pool_of("main")), ["3"])
    assert infra(t) == {"env_infra_failures": 1, "env_infra/factory": 1} and t.reward_info["env_reward"] == 1.0


async def test_a_server_at_its_session_limit_sends_the_episode_to_another_server(tok, servers, pool_of):
    pool = await pool_of("full", "main")
    async with aiohttp.ClientSession() as http, http.ws_connect(servers["full"] + "/ws"):  # holds its one session
        await asyncio.sleep(0.2)
        assert pool.busy == dict.fromkeys(pool.urls, 0)  # both idle: the least-busy rule tries the full one first
        t = await run(tok, agent(tok, pool), ["3"])
    assert infra(t) == {"env_infra_failures": 1, "env_infra/capacity": 1} and t.reward_info["env_reward"] == 1.0


@pytest.mark.parametrize("how", ["r", "s", "v"], ids=["validator_rejected", "step_rejected", "validator_valueerror"])
async def test_an_action_the_environment_rejects_is_the_models_and_keeps_the_reward_so_far(tok, pool_of, how):
    loop = agent(tok, await pool_of("main"))
    t = await run(tok, loop, ["7", how, "3"])
    why = {"r": "an action must be a digit", "s": "no such digit", "v": "the action failed a validator"}[how]
    assert why in t.reward_info["env_task_error"]
    assert t.reward_info["turns"] == 2 and t.reward_info["env_reward"] == 0.25  # ended there: the reward so far
    assert infra(t) == {"env_infra_failures": 0} and not loop.counts


async def test_an_action_field_the_environment_does_not_take_is_a_configuration_error_not_a_reward(tok, pool_of):
    loop = agent(tok, await pool_of("main"), action_key="command")
    with pytest.raises(EnvProtocolError, match=r"'command'.*rollout\.multi_turn\.env\.action_key"):
        await run(tok, loop, ["3"])
    with pytest.raises(EnvProtocolError, match="rejected the reset.*no task has the answer x"):
        await run(tok, agent(tok, loop.pool), ["3"], answer="x")
    assert not loop.counts  # neither retried as infrastructure nor scored
