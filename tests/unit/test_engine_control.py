"""The control plane (fully_async/engines/control.py) against servers on 127.0.0.1: a pool-wide call reaches the
serving and stale servers and no others, each within the deadline (a server that never answers fails the call in
about engine.control_timeout_s, naming it); a server that died under the call is dropped and handed to the pool's
`on_dead`, a live one that failed still fails the call."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from fully_async.config import EngineConfig
from fully_async.engines import EngineError, build_engine
from fully_async.engines.process import free_port
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def silent():
    """An aiohttp server on 127.0.0.1 that accepts every request and never answers."""
    gate = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await gate.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    gate.set()
    await runner.cleanup()


@pytest.fixture
async def fakes():
    started = [await FakeEngine().start() for _ in range(3)]
    yield started
    for fake in started:
        await fake.stop()


def pool(urls: list[str], deadline_s: float = 5.0):
    return build_engine(EngineConfig(control_timeout_s=deadline_s), "/nonexistent", "/tmp", addresses=urls)


async def test_a_pool_wide_call_reaches_the_serving_and_stale_servers_only(fakes):
    servers = pool([f.url for f in fakes])
    servers.slots.mark_stale(1)  # must get the sync that brings it up to date
    servers.slots.mark_down(2)  # dead: nothing to send it
    await servers.pause("abort")
    assert [f.paused for f in fakes] == [True, True, False]
    await servers.set_version(4)
    assert [f.version for f in fakes] == ["4", "4", "default"]


async def test_a_server_that_never_answers_fails_the_call_within_the_deadline(fakes, silent):
    servers = pool([fakes[0].url, silent], deadline_s=0.5)
    assert servers.control.deadline_s == 0.5
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"pause failed on 1 of 2 servers: http://127.0.0.1:\d+: no answer") as e:
        await servers.pause("abort")
    assert silent in str(e.value) and fakes[0].url not in str(e.value)
    assert time.monotonic() - start < 3.0  # the deadline, not the silent server, ended the call
    patient = pool([silent], deadline_s=30.0)
    start = time.monotonic()
    with pytest.raises(EngineError, match="no answer"):  # a per-call deadline overrides the pool's
        await patient.rpc(0, "recv", "{}", timeout_s=0.2)
    assert time.monotonic() - start < 2.0


async def test_a_server_that_died_under_a_call_is_dropped_and_handed_over(fakes, silent):
    dead_url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens: the connection is refused
    servers = pool([fakes[0].url, dead_url, silent], deadline_s=0.5)
    alive = {0: True, 1: False, 2: True}
    servers.is_alive = lambda i: alive[i]  # the process edge: server 1's process is gone, 2's is running
    handed: list[int] = []
    servers.on_dead = handed.append
    with pytest.raises(EngineError, match="failed on 1 of 3 servers") as e:  # the silent live one still fails it
        await servers.resume()
    assert silent in str(e.value) and dead_url not in str(e.value)
    assert handed == [1] and servers.down == {1} and servers.serving == [0, 2]
    alive[2] = False
    await servers.resume()  # the silent one found dead too: the call completes on the rest
    assert handed == [1, 2] and servers.serving == [0]
