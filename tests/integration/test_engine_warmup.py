"""The engines' warm-up (fully_async/engines/warmup.py) on the pool's real lifecycle paths, with the fake engine of
tests/fakes.py run as child processes: a server restarted after it died, and one added mid-run, each answer the
warm-up's requests before the pool serves them again (or lets them join), after the pool's own start warmed all."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from fully_async.config import EngineConfig
from fully_async.engines.types import Sampling
from fully_async.engines.warmup import WarmupPlan
from tests.fakes import FakeProcessServers

pytestmark = pytest.mark.timeout(120)

PLAN = WarmupPlan((3, 4, 5), 4, Sampling(), 2, 30.0)
WARMUP_CALLS = 1 + PLAN.requests


async def _prompts(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url + "/fake_state") as resp:
        return (await resp.json())["prompts"]


async def test_a_restarted_and_an_added_server_are_warmed_before_they_serve(tmp_path):
    servers = FakeProcessServers(EngineConfig(startup_timeout_s=30.0), tmp_path, tmp_path)
    servers.warmup = PLAN
    await asyncio.to_thread(servers.start)
    try:
        assert await _prompts(servers.address(0)) == WARMUP_CALLS
        os.killpg(servers.procs[0].popen.pid, 9)
        servers.slots.mark_down(0)
        await servers.restart_async(0)
        assert servers.serving == [0]
        assert await _prompts(servers.address(0)) == WARMUP_CALLS  # the new process's own warm-up, before serving
        (index,) = await servers.add(1)
        assert await _prompts(servers.address(index)) == WARMUP_CALLS  # before it joined
    finally:
        servers.stop()
