"""The control plane (fully_async/engines/control.py) against servers on 127.0.0.1 and emulated ones: a pool-wide
call reaches the serving and stale servers and no others; a server that does not answer it within
engine.control_deadline_s is set aside (down, handed to the pool's `on_dead`) while the others get the call, and
when none answers the call fails naming them; a slow reload of a live server is waited for (engine.control_timeout_s)
while a hung one is set aside after the deadline; a server that died under the call is dropped and handed over, a
live one that failed still fails the call; engine=sim goes through the same set-aside path."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import EngineError, build_engine, control
from fully_async.engines.process import free_port
from tests.fakes import FakeEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def fakes():
    started = [await FakeEngine().start() for _ in range(3)]
    yield started
    for fake in started:
        await fake.stop()


@pytest.fixture
async def silent():
    """Two servers on 127.0.0.1 that accept every request and never answer (a stopped node's)."""
    started = [await FakeEngine("silent").start() for _ in range(2)]
    yield started
    for fake in started:
        await fake.stop()


def pool(urls: list[str], deadline_s: float = 5.0, timeout_s: float = 30.0):
    cfg = EngineConfig(control_deadline_s=deadline_s, control_timeout_s=timeout_s)
    servers = build_engine(cfg, "/nonexistent", "/tmp", addresses=urls)
    handed: list[int] = []
    servers.on_dead = handed.append
    return servers, handed


async def test_a_pool_wide_call_reaches_the_serving_and_stale_servers_only(fakes):
    servers, _ = pool([f.url for f in fakes])
    servers.slots.mark_stale(1)  # must get the sync that brings it up to date
    servers.slots.mark_down(2)  # dead: nothing to send it
    await servers.pause("abort")
    assert [f.paused for f in fakes] == [True, True, False]
    await servers.set_version(4)
    assert [f.version for f in fakes] == ["4", "4", "default"]


async def test_a_server_that_misses_the_deadline_is_set_aside_and_the_others_get_the_call(fakes, silent):
    servers, handed = pool([fakes[0].url, silent[0].url], deadline_s=0.5, timeout_s=30.0)
    start = time.monotonic()
    await servers.pause("abort")
    # The deadline (0.5 s), not engine.control_timeout_s (30 s), bounded the call: one generous bound.
    assert time.monotonic() - start < 10.0
    assert fakes[0].paused and handed == [1] and servers.down == {1} and servers.serving == [0]
    assert silent[0].unanswered == ["/pause"]
    await servers.set_version(2)  # the one set aside is not called again
    assert fakes[0].version == "2" and handed == [1] and silent[0].unanswered == ["/pause"]
    calls = servers.control.recent_calls()  # what a stuck sync's error shows of each server
    assert re.search(
        rf"- {fakes[0].url}:\n .* POST /pause: ok \(\d.\d+ s\)\n .* POST /update_weight_version: ok", calls
    )
    assert re.search(rf"- {silent[0].url}:\n .* POST /pause: unanswered \(0.5\d\d s\)$", calls), calls


async def test_a_server_on_a_node_ray_reports_dead_is_never_called(fakes, silent):
    servers, handed = pool([fakes[0].url, silent[0].url], deadline_s=5.0)
    servers.on_lost_nodes = lambda indices: [i for i in indices if i == 1]  # the Ray edge: server 1's node is dead
    await servers.pause("abort")
    assert fakes[0].paused and handed == [1] and servers.serving == [0]
    assert silent[0].unanswered == []  # set aside before the call: never called


async def test_when_no_server_answers_in_time_the_call_fails_naming_them(silent):
    servers, handed = pool([s.url for s in silent], deadline_s=0.5)
    with pytest.raises(  # the message names the bound that ended it: the deadline, not control_timeout_s
        EngineError, match=r"pause: no engine server answered in time: .*within engine.control_deadline_s=0.5s"
    ):
        await servers.pause("abort")
    assert handed == [] and servers.serving == [0, 1]


async def test_a_call_to_one_named_server_fails_on_its_own_bound(silent):
    servers, handed = pool([silent[0].url], deadline_s=30.0)
    with pytest.raises(EngineError, match="no answer .* within 0.2 s"):  # a per-call bound overrides the pool's
        await servers.rpc(0, "recv", "{}", timeout_s=0.2)
    assert handed == [] and silent[0].unanswered == ["/collective_rpc"]


async def test_a_slow_reload_of_a_live_server_is_waited_for_and_a_hung_one_set_aside(silent, tmp_path):
    slow = await FakeEngine(
        reload_delay_s=1.5
    ).start()  # a big model loading: longer than the deadline, /health answers
    try:
        servers, handed = pool([slow.url, silent[0].url], deadline_s=0.5, timeout_s=30.0)
        start = time.monotonic()
        await servers.load_weights(tmp_path, 1)
        took = time.monotonic() - start
        assert 1.5 <= took < 1.5 + 10.0  # waited for the reload, well within engine.control_timeout_s (30 s)
        assert slow.reloads == [str(tmp_path.resolve())] and slow.version == "1" and handed == [1]
        servers.control.timeout_s = 0.8  # past engine.control_timeout_s even a live server's reload misses its bound
        with pytest.raises(EngineError, match=r"reload weights: no engine server answered in time: .*/collective_rpc "
                                              r"within engine.control_timeout_s=0.8s"):  # fmt: skip
            await servers.load_weights(tmp_path, 2)
    finally:
        await slow.stop()


async def test_a_server_that_died_under_a_call_is_dropped_and_a_live_failure_still_fails(fakes, silent):
    dead_url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens: the connection is refused
    servers, handed = pool([fakes[0].url, dead_url, silent[0].url], deadline_s=0.5)
    alive = {0: True, 1: False, 2: True}
    servers.is_alive = lambda i: alive[i]  # the process edge: server 1's process is gone, 2's is running
    await servers.resume()
    assert sorted(handed) == [1, 2] and servers.down == {1, 2} and servers.serving == [0]
    live, _ = pool([fakes[1].url, fakes[2].url])
    with pytest.raises(EngineError, match="reload weights failed on 2 of 2 servers: .*no weights directory"):
        await live.load_weights("/nonexistent-weights", 1)


async def test_a_server_whose_connection_broke_is_dropped_when_its_exit_is_seen_only_after_the_failure(fakes):
    # A SIGKILLed server's sockets close before its exit can be seen (on a loaded machine, long enough for the whole
    # fan-out): the broken connection waits up to DEATH_GRACE_S for the process to look gone. An HTTP error of a
    # live server does not wait.
    dead_url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens: the connection is refused
    servers, handed = pool([fakes[0].url, dead_url], deadline_s=5.0)
    died_at = time.monotonic() + 0.3
    servers.is_alive = lambda i: i == 0 or time.monotonic() < died_at
    await servers.set_version(5)
    assert handed == [1] and servers.serving == [0] and fakes[0].version == "5"
    live, handed = pool([fakes[1].url])
    start = time.monotonic()
    with pytest.raises(EngineError, match="no weights directory"):
        await live.load_weights("/nonexistent-weights", 1)
    assert time.monotonic() - start < 1.0 and handed == []


async def test_engine_sim_sets_a_hung_engine_aside_through_the_same_path():
    cfg = EngineConfig(kind="sim", num_servers=3, control_deadline_s=0.5, control_timeout_s=30.0)
    servers = build_engine(cfg, "/nonexistent", "/tmp")
    handed: list[int] = []
    servers.on_dead = handed.append
    servers.kind.engines[1].hung = True
    start = time.monotonic()
    await servers.pause("abort")
    assert time.monotonic() - start < 0.5 + 1.0
    assert handed == [1] and [e.paused for e in servers.kind.engines] == [True, False, True]
    servers.kind.engines[2].hung = True  # stops during the sync: the reload's liveness probe sets it aside
    start = time.monotonic()
    await servers.load_weights("/tmp", 1)
    assert time.monotonic() - start < 0.5 + 1.0
    assert handed == [1, 2] and [e.version for e in servers.kind.engines] == [1, 0, 0]
    servers.kind.engines[0].hung = True
    with pytest.raises(EngineError, match="no engine server answered in time"):
        await servers.resume()


@pytest.mark.parametrize("lag", range(8))
async def test_a_reload_answered_beside_a_liveness_probe_ends(fakes, tmp_path, monkeypatch, lag):
    """Issue 46: a two-node run hung for 300 s in a sync's reload after both servers had reloaded. A reload is watched
    by a liveness probe loop, cancelled when the reload answers; when a probe's answer came in the same few turns of
    the event loop as that cancellation, asyncio.wait_for (Python < 3.12) returned the probe's answer instead of the
    cancellation, the loop probed on forever and the reload waited for it to end. Here the second probe is answered
    `lag` turns after the reload, which sweeps that window deterministically."""
    monkeypatch.setattr(control, "PROBE_EVERY_S", 0.01)
    servers, handed = pool([fakes[0].url], deadline_s=5.0, timeout_s=30.0)
    deliver, liveness = servers.control.deliver, servers.kind.liveness_path
    answered, reloaded, probes = asyncio.Event(), asyncio.Event(), []

    async def scripted(session, url, call):  # the HTTP edge: the real fake server, with the answers' order set
        answer = await deliver(session, url, call)
        if call.path == liveness:
            probes.append(call)
            if len(probes) == 2:  # the reload answers now, this probe `lag` turns later
                answered.set()
                await reloaded.wait()
                for _ in range(lag):
                    await asyncio.sleep(0)
        elif call.path == "/collective_rpc":
            await answered.wait()
            reloaded.set()
        return answer

    servers.control.deliver = scripted
    async with asyncio.timeout(10):
        await servers.load_weights(tmp_path, 1)
    assert fakes[0].version == "1" and handed == []
    probed = len(probes)
    await asyncio.sleep(0.2)
    assert len(probes) == probed  # nothing probes on after the reload ended
