"""The emulated engines (engine=sim) behind the real EngineClient and control plane: the same contracts the fake
HTTP engine is held to in test_engine_client.py (budget across aborts, per-token versions, pause/abort/continue,
restart without partial rollout), plus the latency model itself."""

from __future__ import annotations

import asyncio
import time

import pytest

from fully_async.config import ConfigError, EngineConfig, SimEngineConfig, compose
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.engines.sim import LengthModel, _trailing_run
from tests.helpers import generate_across_a_sync

pytestmark = pytest.mark.timeout(60)
STOP = 256


def make(num_servers: int = 1, **sim) -> EngineClient:
    defaults = dict(decode_step_s=0.002, decode_step_per_seq_s=0.0, length_sigma=0.0, length_median=1000.0)
    cfg = EngineConfig(kind="sim", num_servers=num_servers, sim=SimEngineConfig(**{**defaults, **sim}))
    servers = build_engine(cfg, "/nonexistent", "/tmp")
    servers.start()
    return EngineClient(servers)


SAMPLING = Sampling(stop_token_ids=(STOP,))


async def test_budget_caps_a_long_response_and_tokens_carry_the_version():
    client = make(length_median=1000)
    await client.servers.set_version(3)
    out = await client.generate([10, 11, 12], 20, SAMPLING)
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 20
    assert out.finish_reason == "length" and list(out.versions) == [3] * 20 and out.start_version == 3
    assert set(out.token_ids) == {client.servers.cfg.sim.token_id}


async def test_a_short_response_stops_with_the_stop_token():
    client = make(length_median=7)
    out = await client.generate([10, 11], 50, SAMPLING)
    assert len(out.token_ids) == 7 and out.finish_reason == "stop" and out.token_ids[-1] == STOP


@pytest.mark.parametrize("pause_after_s", [0.0, 0.03, 0.1])
async def test_abort_continue_keeps_budget_and_splits_versions(tmp_path, pause_after_s):
    client = make(length_median=1000)
    servers = client.servers
    budget = 100  # 0.2 s of decoding at 2 ms a token
    out = await generate_across_a_sync(client, tmp_path, [1, 2, 3], budget, pause_after_s, SAMPLING)
    assert len(out.token_ids) == len(out.versions) == budget
    assert out.num_aborts == 1 and out.finish_reason == "length"
    k = list(out.versions).count(0)
    assert list(out.versions) == [0] * k + [1] * (budget - k)
    assert client.stats.carried_tokens == k
    assert k < budget and (k > 0 or pause_after_s < 0.02)
    assert servers.kind.engines[0].reloads == [str(tmp_path.resolve())] and servers.state.version == 1


async def test_a_continuation_keeps_the_sample_length(tmp_path):
    """An aborted sample continued under new weights still ends at its own length, not at a fresh draw's."""
    # Long enough (2000 tokens) that a busy machine cannot finish it before the pause; it has begun when the pause
    # comes (the sleep), so some tokens are version 0's.
    client = make(length_median=2000)
    task = asyncio.create_task(client.generate([5], 5000, SAMPLING))
    await asyncio.sleep(0.06)
    await client.servers.pause("abort")
    await client.servers.load_weights(tmp_path, 1)
    await client.servers.resume()
    out = await task
    assert out.num_aborts == 1 and 0 < list(out.versions).count(0) < 2000
    assert len(out.token_ids) == 2000 and out.finish_reason == "stop" and out.token_ids[-1] == STOP


async def test_without_partial_rollout_an_aborted_sample_restarts_under_the_new_version(tmp_path):
    client = make(length_median=1000)
    task = asyncio.create_task(client.generate([5], 60, SAMPLING, continue_on_abort=False))
    await asyncio.sleep(0.05)
    await client.servers.pause("abort")
    await client.servers.load_weights(tmp_path, 1)
    await client.servers.resume()
    out = await task
    assert out.num_aborts == 1 and client.stats.carried_tokens == 0
    assert list(out.versions) == [1] * 60 and out.start_version == 1


async def test_pause_keep_freezes_and_the_segment_keeps_the_engines_per_token_labels():
    client = make(length_median=1000)
    task = asyncio.create_task(client.generate([5], 50, SAMPLING))
    await asyncio.sleep(0.03)
    await client.servers.pause("keep")
    frozen_at = time.monotonic()
    await client.servers.set_version(1)
    await asyncio.sleep(0.2)  # longer than the whole request: it must not finish while frozen
    assert not task.done()
    await client.servers.resume()
    out = await task
    assert time.monotonic() - frozen_at >= 0.2
    k = list(out.versions).count(0)  # outlived a version change without an abort, each token labelled as produced
    assert out.num_aborts == 0 and 0 < k < 50 and list(out.versions) == [0] * k + [1] * (50 - k)


async def test_requests_arriving_while_paused_wait_for_the_resume():
    client = make(length_median=5)
    await client.servers.pause("abort")
    engine = client.servers.kind.engines[0]
    task = asyncio.create_task(engine.generate([1], 10, SAMPLING))
    await asyncio.sleep(0.05)
    assert not task.done()
    await client.servers.resume()
    assert len((await task).token_ids) == 5


async def test_decode_slows_with_the_batch_and_requests_spread_over_engines():
    client = make(num_servers=2, decode_step_s=0.001, decode_step_per_seq_s=0.001, length_median=100)
    start = time.monotonic()
    await client.generate([1], 100, SAMPLING)
    alone = time.monotonic() - start
    start = time.monotonic()
    outs = await asyncio.gather(*(client.generate([1], 100, SAMPLING) for _ in range(16)))
    crowded = time.monotonic() - start
    assert all(len(o.token_ids) == 100 for o in outs)
    # 8 sequences per engine: 9 ms steps instead of 2 ms.
    assert crowded > 2.5 * alone
    assert [e.generated_tokens for e in client.servers.kind.engines] == [900, 800]


def test_length_model_conditioning_and_trailing_run():
    import random

    lengths = LengthModel(500, 1.2, random.Random(0))
    draws = [lengths.draw() for _ in range(4000)]
    assert 400 < sorted(draws)[2000] < 620  # the median
    assert all(lengths.draw(longer_than=3000) > 3000 for _ in range(200))
    assert _trailing_run([1, 2, 3, 3, 3], 3) == 3 and _trailing_run([3, 3], 3) == 2 and _trailing_run([1, 2], 3) == 0


def test_sim_config_is_validated():
    with pytest.raises(ConfigError, match="engine.sim.time_scale"):
        compose(["engine=sim", "engine.sim.time_scale=0"])
    with pytest.raises(ConfigError, match="trainer.sim.time_scale must equal engine.sim.time_scale"):
        compose(["engine=sim", "trainer=sim", "engine.sim.time_scale=5"])
    with pytest.raises(ConfigError, match="engine.sim.max_seqs"):
        compose(["engine=sim", "engine.sim.max_seqs=0"])
    cfg = compose(["engine=sim", "trainer=sim"])
    assert cfg.engine.kind == "sim" and cfg.trainer.backend == "sim"
