"""Reward models: dynamic batching on the real tiny model (in process and in a Ray worker), and the service client
with least-outstanding routing against two reward-model servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from fully_async.config import RewardConfig, RewardModelConfig, RewardSourceConfig, TinyModelConfig
from fully_async.models import build_tiny_model
from fully_async.reward import RewardAgent
from fully_async.reward.reward_model import LocalRewardModel
from tests.reward_server import RewardModelServer

META = {"data_source": "rm_test", "ground_truth": "7", "extra_info": {}, "question": "What is 3+4?"}


@pytest.fixture(scope="module")
def tiny_path() -> str:
    return str(build_tiny_model(TinyModelConfig()))


@pytest.mark.parametrize("n", [1, 10])
async def test_dynamic_batching_n_requests_make_ceil_n_over_max_batch_passes(tiny_path, n):
    max_batch, wait_ms = 4, 300.0
    rm = LocalRewardModel(tiny_path, max_batch=max_batch, max_wait_ms=wait_ms)
    await rm.score("warm", "up")  # the first pass pays torch's one-time start-up
    rm.batcher.batches.clear()
    start = time.monotonic()
    scores = await asyncio.gather(*(rm.score("What is 3+4?", f"answer {i}") for i in range(n)))
    elapsed = time.monotonic() - start
    assert len(rm.batcher.batches) == math.ceil(n / max_batch) and sum(rm.batcher.batches) == n
    assert all(math.isfinite(s) for s in scores) and len(set(scores)) == n  # each answer scored on its own
    # Full batches run at once; the last partial one waits for T, never longer (plus the passes themselves).
    if n % max_batch:
        assert elapsed >= wait_ms / 1000 * 0.9
    assert elapsed < wait_ms / 1000 + 2.0
    # Batching does not change a score: the same answer alone gives the same value.
    alone = await rm.score("What is 3+4?", "answer 0")
    assert alone == pytest.approx(scores[0], abs=1e-5)


async def test_reward_model_in_a_ray_worker_batches_across_concurrent_samples(ray_local, tiny_path):
    rm = RewardModelConfig(path=tiny_path, max_batch=4, max_wait_ms=500.0)
    agent = RewardAgent(RewardConfig([RewardSourceConfig(kind="reward_model", timeout_s=60, reward_model=rm)]))
    try:
        await agent.score("warm", META)
        actor = agent.sources[0].source.actors[0]
        before = len(await actor.forward_passes.remote())
        results = await asyncio.gather(*(agent.score(f"answer {i}", META) for i in range(8)))
        assert not any(r.info.get("reward_failed") for r in results)
        assert len(await actor.forward_passes.remote()) - before == 2
    finally:
        await agent.aclose()


@pytest.mark.parametrize("endpoint", ["classify", "pooling"])
async def test_service_client_routes_to_the_least_busy_replica(endpoint):
    fast, slow = await RewardModelServer(latency_s=0.01).start(), await RewardModelServer(latency_s=0.5).start()
    rm = RewardModelConfig(urls=[slow.url, fast.url], endpoint=endpoint, label=1)
    agent = RewardAgent(RewardConfig([RewardSourceConfig(kind="reward_model", reward_model=rm)]))
    deadline = time.monotonic() + 1.5
    try:

        async def lane(k: int) -> int:
            i = 0
            while time.monotonic() < deadline:
                r = await agent.score("x" * (k * 10 + i % 10), META)
                assert r.score == pytest.approx((k * 10 + i % 10) / 100)  # probs[label] of this very response
                i += 1
            return i

        done = sum(await asyncio.gather(*(lane(k) for k in range(3))))
        assert fast.served + slow.served == done
        # Round-robin would send the slow replica a third of the calls; least-outstanding sends it a lane at most
        # (ties go to the first listed, the slow one) while the fast one turns the others over.
        assert slow.served <= 2 * 1.5 / 0.5 + 1 and fast.served > 5 * slow.served
    finally:
        await agent.aclose()
        await fast.stop()
        await slow.stop()
