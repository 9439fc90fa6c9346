"""fully_async/engines/warmup.py against servers on 127.0.0.1: each server started by the pool answers one request
alone, then `requests` at once, of the plan's prompt and length, before the pool's start returns (so before any
traffic); the answers change nothing the run sees (no version); a server whose warm-up fails or hangs is logged and
serves cold within the plan's bound, and the pool starts all the same."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import build_engine
from fully_async.engines.types import Sampling
from fully_async.engines.warmup import WarmupPlan, warm
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)


def plan(requests: int = 3, timeout_s: float = 30.0) -> WarmupPlan:
    return WarmupPlan((5, 6, 7, 8), 6, Sampling(temperature=1.0), requests, timeout_s)


def test_the_plan_takes_the_longest_prompt_and_none_means_no_warmup():
    p = WarmupPlan.of_run([[1, 2], [3, 4, 5], [6]], 16, Sampling(), 4, 60.0)
    assert p.prompt_ids == (3, 4, 5) and p.max_tokens == 16 and p.requests == 4
    assert WarmupPlan.of_run([[1]], 4096, Sampling(), 4, 60.0).max_tokens == 64  # no long decode: no new shapes
    assert WarmupPlan.of_run([[1]], 16, Sampling(), 0, 60.0) is None
    assert WarmupPlan.of_run([], 16, Sampling(), 4, 60.0) is None


async def test_the_pools_start_warms_every_server_before_it_returns():
    fakes = [await FakeEngine().start() for _ in range(2)]
    try:
        servers = build_engine(EngineConfig(), "/nonexistent", "/tmp", addresses=[f.url for f in fakes])
        servers.warmup = plan(requests=3)
        await asyncio.to_thread(servers.start)
        for fake in fakes:
            assert fake.generate_calls == 1 + 3
            assert fake.prompts == [[5, 6, 7, 8]] * 4
            assert fake.version == "0"  # set before the warm-up; the throw-away answers moved nothing
        launch, warmup = servers.started_at["engine_launch"], servers.started_at["engine_warmup"]
        assert launch[0] <= launch[1] == warmup[0] <= warmup[1]
    finally:
        for fake in fakes:
            await fake.stop()


async def test_a_failing_or_hung_warmup_is_logged_and_the_server_serves_cold(caplog):
    good, broken, silent = FakeEngine(), FakeEngine("5xx"), FakeEngine("silent")
    for f in (good, broken, silent):
        await f.start()
    try:
        servers = build_engine(EngineConfig(), "/nonexistent", "/tmp", addresses=[good.url, broken.url, silent.url])
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fully_async.engines.warmup"):
            spent = await warm(servers, servers.procs, plan(requests=2, timeout_s=1.0))
        assert time.monotonic() - start < 5.0
        assert set(spent) == {good.url, broken.url, silent.url}
        assert good.generate_calls == 3 and broken.generate_calls == 1  # the first failure gives the rest up
        warned = [r.getMessage() for r in caplog.records]
        assert any(broken.url in w and "HTTP 500" in w and "serves cold" in w for w in warned)
        assert any(silent.url in w and "no answer within 1 s" in w for w in warned)
        assert not any(good.url in w for w in warned)
    finally:
        for f in (good, broken, silent):
            await f.stop()


async def test_no_plan_sends_nothing():
    fake = await FakeEngine().start()
    try:
        servers = build_engine(EngineConfig(), "/nonexistent", "/tmp", addresses=[fake.url])
        assert await warm(servers, servers.procs, None) == {}
        await asyncio.to_thread(servers.start)
        assert fake.generate_calls == 0
    finally:
        await fake.stop()
