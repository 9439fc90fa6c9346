"""A hung engine server comes back (fully_async/engines/hung.py, elastic.py `relaunch`, recovery.py), with real
processes: the fake engine of tests/fakes.py under Ray-placed EngineHost actors on the session's local Ray node.

A hang is made by SIGSTOP of the processes by pid: the engine host actor's worker and its server (a hung node, as
its host sees it: the host does not answer, Ray keeps the node alive), or the server alone (the host answers). A
sync's pause meets it, sets it aside after engine.control_deadline_s, and the client's recovery brings it back:

- host hung, and still hung after engine.hung_host_s: replaced on a new host (a new URL), current, serving;
- host hung, continued (SIGCONT) before engine.hung_host_s: restarted in place (its URL), current, serving;
- server hung alone, host fine: restarted in place at once (no wait for the host);
- a restart that fails (here a child-process server's, scripted once) is logged and tried again after
  engine.replace_retry_s, never abandoned.

The same with a whole Ray node stopped, in a real job, is tests/integration/test_hung_node.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import aiohttp
import psutil
import pytest

from fully_async.config import EngineConfig, compose
from fully_async.engines import EngineClient
from fully_async.engines.errors import EngineError
from fully_async.engines.slots import SlotState
from tests.fakes import FakeProcessServers

pytestmark = pytest.mark.timeout(180)

HUNG_HOST_S = 3.0


async def _state(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/fake_state") as resp:
        return await resp.json()


def _tree(*pids: int) -> list[int]:
    """`pids` and their descendants (a server runs under its watchdog)."""
    out = []
    for pid in pids:
        out += [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(pid, sig)


async def _pool(tmp_path, hung_host_s: float):
    import ray

    from fully_async.engines.host import HostFactory

    cfg = compose(["engine.startup_timeout_s=30", "placement.engine_cpus=0.01", "engine.control_deadline_s=1",
                   f"engine.hung_host_s={hung_host_s}", "engine.replace_retry_s=1"])  # fmt: skip
    factory = HostFactory(cfg, str(tmp_path), ray.get_runtime_context().get_node_id(), None, None, gpu=False)
    servers = FakeProcessServers(cfg.engine, tmp_path, tmp_path, hosts=[factory.create(0), factory.create(1)])
    servers.host_factory = factory
    await asyncio.to_thread(servers.start)
    return servers


async def _hang_and_sync(servers, pids: list[int], tmp_path) -> None:
    """Stop `pids`, then a sync: its pause sets server 1 aside (it does not answer), the rest goes on with server 0."""
    _signal(pids, signal.SIGSTOP)
    await servers.pause("abort")
    assert servers.down == {1}
    await servers.load_weights(tmp_path, 2)
    await servers.resume()


async def _back(servers, index: int) -> None:
    """Until server `index` serves again (the recovery runs in the background)."""
    for _ in range(1200):
        if servers.slots[index] is SlotState.SERVING:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"server {index} not back: {servers.slots[index]}")


async def test_a_server_whose_host_stays_hung_is_replaced_after_the_bound(ray_local, tmp_path):
    servers = await _pool(tmp_path, HUNG_HOST_S)
    where = ray_local.get(servers.procs[1].host.where.remote())
    pids = _tree(where["host_pid"])
    try:
        client = EngineClient(servers, auto_restart=True)
        old_url = servers.address(1)
        await _hang_and_sync(servers, pids, tmp_path)
        await _back(servers, 1)  # Ray never declares this node dead: only our bound replaces it
        new_url = servers.address(1)
        assert new_url != old_url and servers.pool_events == [("replace", 1, old_url, new_url)]
        assert client.stats.restarts == 1 and servers.serving == [0, 1]
        state = await _state(new_url)
        assert state["version"] == "2" and state["reloads"] == [str(tmp_path.resolve())]  # current before serving
        client.outstanding[:] = [1, 0]  # the balancer picks the replacement
        out = await client.generate([1, 2], 3)
        assert out.servers == [new_url] and out.versions == [2] * 3
        await client.close()
    finally:
        _signal(pids, signal.SIGCONT)  # the killed host and its server end once they run
        servers.stop()


async def test_a_hung_host_that_continues_before_the_bound_is_restarted_in_place(ray_local, tmp_path):
    servers = await _pool(tmp_path, 120.0)
    where = ray_local.get(servers.procs[1].host.where.remote())
    pids = _tree(where["host_pid"])
    try:
        client = EngineClient(servers, auto_restart=True)
        old_url = servers.address(1)
        await _hang_and_sync(servers, pids, tmp_path)
        await asyncio.sleep(2.5)  # the recovery asks the host (deadline 1 s), finds it silent, and waits
        assert servers.slots[1] is SlotState.DOWN and client.stats.restarts == 0
        _signal(pids, signal.SIGCONT)
        await _back(servers, 1)
        assert servers.address(1) == old_url and servers.pool_events == []  # in place, not replaced
        assert ray_local.get(servers.procs[1].host.where.remote())["server_pid"] != where["server_pid"]
        assert client.stats.restarts == 1 and servers.serving == [0, 1]
        assert (await _state(old_url))["version"] == "2"
        await client.close()
    finally:
        _signal(pids, signal.SIGCONT)
        servers.stop()


async def test_a_server_hung_alone_is_restarted_in_place(ray_local, tmp_path):
    servers = await _pool(tmp_path, 120.0)
    where = ray_local.get(servers.procs[1].host.where.remote())
    pids = _tree(where["server_pid"])  # the server and its children; its host answers
    try:
        client = EngineClient(servers, auto_restart=True)
        old_url = servers.address(1)
        await _hang_and_sync(servers, pids, tmp_path)
        await _back(servers, 1)
        assert servers.address(1) == old_url and servers.pool_events == []
        after = ray_local.get(servers.procs[1].host.where.remote())
        assert after["host_pid"] == where["host_pid"] and after["server_pid"] != where["server_pid"]
        assert client.stats.restarts == 1 and client.recovery.failed_tries == 0
        assert (await _state(old_url))["version"] == "2"
        await client.close()
    finally:
        _signal(pids, signal.SIGCONT)
        servers.stop()


class FailsOnce(FakeProcessServers):
    """The first restart fails (a node out of memory, a port taken): the recovery must try again, not give up."""

    failures = 1

    def relaunch(self, index: int) -> None:
        if self.failures:
            self.failures -= 1
            raise EngineError(f"{self.kind}-{index}: scripted start-up failure")
        super().relaunch(index)


async def test_a_restart_that_fails_is_tried_again_not_abandoned(tmp_path):
    servers = FailsOnce(EngineConfig(num_servers=2, startup_timeout_s=30.0, replace_retry_s=0.2), tmp_path, tmp_path)
    await asyncio.to_thread(servers.start)
    try:
        client = EngineClient(servers, auto_restart=True)
        pids = _tree(servers.procs[1].popen.pid)
        await _hang_and_sync(servers, pids, tmp_path)
        await _back(servers, 1)
        assert servers.failures == 0 and client.recovery.failed_tries == 1 and client.stats.restarts == 1
        assert (await _state(servers.address(1)))["version"] == "2"
        await client.close()
    finally:
        servers.stop()
