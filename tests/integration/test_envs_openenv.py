"""OpenEnvAgentLoop against real OpenEnv server processes (fully_async/envs/digits.py served by openenv-core's own
server, launched by the pool on 127.0.0.1); the engine is the scripted client of tests/fakes.py (the edge), so the
episode's text, and hence the environment's verdict, is known. A multi-turn episode token by token; a server
SIGKILLed mid-episode: the episode restarts on a fresh environment and keeps the environment's true reward (never a
fake 0), the pool replaces the dead server; past the retry budget the sample raises for re-issue."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import numpy as np
import pytest
import pytest_asyncio

from fully_async.agents import Sample
from fully_async.config import EnvConfig, MultiTurnConfig
from fully_async.data import PromptRow
from fully_async.engines import Sampling
from fully_async.engines.process import free_port
from fully_async.envs.failures import InfraExhausted
from fully_async.envs.openenv import OpenEnvAgentLoop
from fully_async.envs.pool import EnvServerPool
from fully_async.envs.reward import env_reward
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import NO_VERSION, PromptRef
from tests import fakes

# One pool of two server processes for the module (each start costs seconds of imports): the tests share its loop.
pytestmark = [pytest.mark.needs_extra("envs"), pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def sample(answer="3"):
    return Sample(PromptRef(0, 5), 1, PromptRow("t", [{"role": "user", "content": "digit?"}], answer))


def agent(tok, pool, retries=2, on_exhausted="reissue"):
    env = EnvConfig(infra_retries=retries, on_exhausted=on_exhausted, call_timeout_s=10.0, health_interval_s=0.5)
    return OpenEnvAgentLoop(tok, Sampling(), 200, multi_turn=MultiTurnConfig(max_turns=3, env=env), pool=pool)


def im_end(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tmp_path_factory):
    cfg = EnvConfig(servers=2, health_interval_s=0.5, call_timeout_s=10.0)
    pool = EnvServerPool(cfg, tmp_path_factory.mktemp("envs"))
    await pool.start()
    yield pool
    await pool.stop()


async def test_two_turn_episode_is_token_exact_and_carries_the_environments_reward(tok, pool):
    client = fakes.ScriptedClient(tok, ["7", "3"], end=im_end(tok))
    loop = agent(tok, pool)
    t = await loop.run(client, sample("3"))
    turn = [tok.encode("7")[0], im_end(tok)]
    feedback = loop.chat.boundary(im_end(tok)) + loop.chat.delta([{"role": "user", "content": "Wrong, try again."}])
    assert t.response_ids.tolist() == turn + feedback + [tok.encode("3")[0], im_end(tok)]
    assert t.loss_mask.tolist() == [1, 1] + [0] * len(feedback) + [1, 1]
    assert (t.token_versions[t.loss_mask == 0] == NO_VERSION).all()
    assert client.prompts[1] == client.prompts[0] + turn + feedback  # the model continued from the exact tokens
    assert "Reply with the digit." in tok.decode(client.prompts[0])  # the reset observation is the last user turn
    assert t.reward_info["env_reward"] == 0.5 and t.reward_info["env_turns"] == 1  # right on the second try
    assert t.reward_info["env_retries"] == 0
    meta = loop.reward_meta(t, sample("3").row)
    assert await env_reward("t", "", "3", meta["extra_info"]) == {"score": 0.5}


async def test_a_server_sigkilled_mid_episode_is_retried_on_a_fresh_environment_and_replaced(tok, pool):
    killed = []

    async def kill_busy_server(k):
        if k == 1:  # after the first step: the session's server dies before the second step
            url = next(u for u, n in pool.busy.items() if n)
            server = next(s for s in pool.servers if s.url == url)
            os.killpg(server.popen.pid, signal.SIGKILL)
            killed.append(url)
            await asyncio.sleep(0.2)

    # Attempt 1: "7" (wrong), the server dies, "3" cannot be stepped. Attempt 2, fresh environment: "3".
    client = fakes.ScriptedClient(tok, ["7", "3", "3"], end=im_end(tok), before_turn=kill_busy_server)
    t = await agent(tok, pool).run(client, sample("3"))
    deadline = time.monotonic() + 120
    while (pool.replacements < 1 or not all(pool.up.get(u) for u in pool.urls)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    replacements, up = pool.replacements, dict(pool.up)
    assert len(killed) == 1
    assert t.reward_info["env_infra_failures"] == 1 and t.reward_info["env_retries"] == 1
    assert t.reward_info["env_reward"] == 1.0, "the retried episode must keep the environment's own reward"
    assert t.reward_info["turns"] == 1  # only the fresh attempt's tokens: the broken one is discarded whole
    assert t.response_ids.tolist() == [tok.encode("3")[0], im_end(tok)]
    assert replacements == 1 and all(up.values())


async def test_past_the_retry_budget_the_sample_raises_for_reissue_or_keeps_zero_when_asked(tok, tmp_path):
    dead = EnvServerPool(EnvConfig(urls=[f"http://127.0.0.1:{free_port()}"], call_timeout_s=2.0), tmp_path)
    dead.up[dead.urls[0]] = True  # an external server that has gone: every call is refused

    async def run(loop):
        return await loop.run(fakes.ScriptedClient(tok, ["3"] * 3, end=im_end(tok)), sample("3"))

    loop = agent(tok, dead, retries=1)
    with pytest.raises(InfraExhausted, match="2 attempts failed; last: refused"):
        await run(loop)
    assert loop.counts["env_infra_failures"] == 2 and loop.counts["env_exhausted"] == 1

    dead.up[dead.urls[0]] = True
    t = await run(agent(tok, dead, retries=0, on_exhausted="zero_reward"))
    assert t.reward_info["env_zeroed"] and t.reward_info["env_reward"] == 0.0
    assert t.loss_mask.sum() == 0  # nothing of it is trained as the model's


async def test_a_zeroed_sample_carries_the_newest_version_so_it_is_trained_not_dropped_as_stale(tok, pool, tmp_path):
    loop = agent(tok, pool, retries=0, on_exhausted="zero_reward")
    await loop.run(fakes.ScriptedClient(tok, ["3"], end=im_end(tok), versions=[np.int32(4)]), sample("3"))
    dead = EnvServerPool(EnvConfig(urls=[f"http://127.0.0.1:{free_port()}"], call_timeout_s=2.0), tmp_path)
    dead.up[dead.urls[0]] = True
    loop.pool = dead
    t = await loop.run(fakes.ScriptedClient(tok, ["3"], end=im_end(tok), versions=[4]), sample("3"))
    assert t.reward_info["env_zeroed"] and t.min_version == 4  # version 0 would read as 4 versions stale
    assert json.dumps(t.start_version) == "4"  # a plain int: the trajectory log is JSON


async def test_partial_rollout_off_restarts_an_episode_that_would_span_two_versions(tok, pool):
    client = fakes.ScriptedClient(tok, ["7", "3", "7", "3"], end=im_end(tok), versions=[0, 1, 1, 1])
    loop = agent(tok, pool)
    loop.continue_on_abort = False
    t = await loop.run(client, sample("3"))
    assert t.reward_info["restarts"] == 1 and t.reward_info["env_reward"] == 0.5
    assert set(t.token_versions[t.loss_mask == 1].tolist()) == {1}  # one version: the restarted episode only
