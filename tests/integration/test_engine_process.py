"""Server launching without vLLM: real child processes running a fake engine (tests/fakes.py) that never becomes
healthy or exits at once, and a client driving a launched fake through a restart. Checks no process outlives stop()."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import pytest

from fully_async.config import EngineConfig
from fully_async.device import cpu_binding, engine_cpus
from fully_async.engines import EngineClient, EngineError
from fully_async.engines.process import REPLACED_GRACE_S
from tests.fakes import FakeProcessServers

pytestmark = pytest.mark.timeout(120)


def _servers(tmp_path, mode: str, **cfg) -> FakeProcessServers:
    servers = FakeProcessServers(EngineConfig(**{"startup_timeout_s": 20.0, **cfg}), tmp_path, tmp_path)
    servers.mode = mode
    return servers


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _processes_with(arg: str) -> list[int]:
    """PIDs whose command line has `arg` as one of its words."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                words = f.read().decode(errors="replace").split("\0")
        except OSError:  # not a process, or it exited while we looked
            continue
        if arg in words:
            pids.append(int(entry))
    return pids


def test_never_healthy_server_fails_with_its_log_and_is_cleaned_up(tmp_path):
    # 10 s: the fake's banner (the log tail checked below) comes after its imports, seconds on a loaded machine
    servers = _servers(tmp_path, "never_healthy", startup_timeout_s=10.0)
    with pytest.raises(EngineError) as err:
        servers.start()
    msg = str(err.value)
    assert "not healthy after 10 s" in msg and servers.addresses[0] in msg
    assert str(servers.log_path(0)) in msg and "fake engine (never_healthy)" in msg  # the log tail
    assert servers.procs[0].popen is None  # start() stopped what it had launched before raising
    assert not _processes_with(str(servers.procs[0].port))


def test_server_that_exits_reports_exit_code_and_log(tmp_path):
    servers = _servers(tmp_path, "exit")
    with pytest.raises(EngineError, match=r"exited with code 3 before becoming healthy(.|\n)*bad flag --nope"):
        servers.start()


async def test_launched_server_restart_keeps_address_weights_and_version(tmp_path):
    servers = _servers(tmp_path, "ok", num_servers=2)
    await asyncio.to_thread(servers.start)
    try:
        client = EngineClient(servers, auto_restart=True, max_retries=2)
        await servers.pause("abort")
        await servers.load_weights(tmp_path, 5)
        await servers.resume()
        url0, pid0 = servers.addresses[0], servers.procs[0].popen.pid
        os.killpg(pid0, 9)
        # Both servers are idle so the first pick is server 0, the dead one: a retry goes to server 1 and a
        # restart of server 0 begins in the background.
        out = await client.generate([1, 2], 4)
        assert out.num_retries == 1 and out.servers == [servers.addresses[1]] and out.versions == [5] * 4
        for _ in range(200):
            if not client.down:
                break
            await asyncio.sleep(0.05)
        assert client.down == set() and client.stats.restarts == 1
        assert servers.addresses[0] == url0 and servers.procs[0].popen.pid != pid0 and _gone(pid0)
        client.outstanding[:] = [0, 1]  # steer the next request to the restarted server
        again = await client.generate([1, 2], 4)
        assert again.servers == [url0] and again.versions == [5] * 4  # the version was re-applied on restart
        await client.close()
    finally:
        pids = [p.popen.pid for p in servers.procs if p.popen]
        servers.stop()
    assert all(_gone(pid) for pid in pids)


def test_a_server_restarted_after_failing_is_killed_when_it_does_not_exit_at_once(tmp_path):
    """A restart (recovery's, of a server set aside: elastic.relaunch) gives the old server REPLACED_GRACE_S to exit on
    SIGTERM, then kills it: its requests went on on the others, and a server continued after a hang (vLLM's) would
    otherwise spend the watchdog's 10 s shutting down. Here the old server ignores SIGTERM."""
    servers = _servers(tmp_path, "slow_exit")
    servers.start()
    try:
        pid0 = servers.procs[0].popen.pid
        servers.mode = "ok"  # its successor exits on SIGTERM as usual (a quick stop at the end)
        restart = threading.Thread(target=servers.restart, args=(0,))
        start = time.monotonic()
        restart.start()
        while not _gone(pid0) and time.monotonic() - start < 30:
            time.sleep(0.05)
        gone_after = time.monotonic() - start
        restart.join(60)
        assert not restart.is_alive() and servers.procs[0].popen.pid != pid0
        # REPLACED_GRACE_S (2 s) and the kill; the watchdog's own SIGTERM grace would have taken 10 s.
        assert gone_after < REPLACED_GRACE_S + 4.0, f"the old server went after {gone_after:.1f} s"
    finally:
        servers.stop()


async def test_a_dead_server_is_logged_once_however_many_requests_it_held(tmp_path, caplog):
    servers = _servers(tmp_path, "ok", num_servers=2)
    servers.token_delay_s = 0.05  # 2 s per request: in flight when the server is killed
    await asyncio.to_thread(servers.start)
    try:
        client = EngineClient(servers, auto_restart=True, max_retries=2)
        url0, pid0 = servers.addresses[0], servers.procs[0].popen.pid
        jobs = [asyncio.create_task(client.generate([1, i], 40)) for i in range(8)]
        for _ in range(100):
            if client.outstanding[0] >= 3:
                break
            await asyncio.sleep(0.02)
        held = client.outstanding[0]
        assert held >= 3
        caplog.set_level(logging.INFO, logger="fully_async.engines")
        os.killpg(pid0, 9)
        results = await asyncio.gather(*jobs)
        assert all(len(r.token_ids) == 40 for r in results)  # nothing lost: they went on on server 1
        for _ in range(200):
            if not client.down:
                break
            await asyncio.sleep(0.05)
        assert client.stats.restarts == 1
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("fully_async.engines")]
        assert len([m for m in lines if "died" in m]) == 1, lines
        assert [m for m in lines if "is back" in m] == [
            f"engine server {url0} is back; {held} request(s) failed on it and went on on the others"
        ]
        assert not [m for m in lines if "retrying" in m], lines  # the requests say nothing each
        assert client.stats.retries == held
        await client.close()
    finally:
        servers.stop()


async def test_a_killed_servers_shared_memory_goes_at_its_restart_and_the_stopped_ones_at_stop(tmp_path):
    from multiprocessing.shared_memory import SharedMemory

    from fully_async.engines.process import SHM, release_shm, shm_record

    servers = _servers(tmp_path, "shm", num_servers=1)
    await asyncio.to_thread(servers.start)
    other = SharedMemory(create=True, size=4096)  # another process's segment (this test's): never touched
    try:
        record = shm_record(servers.log_path(0))
        first = [e["name"] for e in json.loads(record.read_text())]
        assert first and all((SHM / name).exists() for name in first)
        assert other.name.lstrip("/") not in first
        assert release_shm(record) == [] and record.exists()  # a live server's files are never removed
        pid = servers.procs[0].popen.pid
        os.killpg(pid, 9)  # server, watchdog, Python's resource tracker: nothing of it can clean up
        for _ in range(100):
            if _gone(pid):
                break
            await asyncio.sleep(0.05)
        assert all((SHM / name).exists() for name in first)  # left behind by the kill
        await asyncio.to_thread(servers.restart, 0)
        assert not any((SHM / name).exists() for name in first)  # the restart removed what the killed one left
        second = [e["name"] for e in json.loads(record.read_text())]
        assert second and not set(second) & set(first) and all((SHM / name).exists() for name in second)
        await asyncio.to_thread(servers.stop)
        assert not any((SHM / name).exists() for name in second) and not record.exists()
        assert (SHM / other.name.lstrip("/")).exists()
    finally:
        servers.stop()
        other.close()
        other.unlink()


def test_cpu_binding_gives_disjoint_cores():
    assert cpu_binding(0, 1, [0, 1]) == "0"
    assert [cpu_binding(i, 2, [0, 1, 2, 3, 4]) for i in range(2)] == ["0,1", "2,3"]
    assert [cpu_binding(i, 3, [0, 1]) for i in range(3)] == ["0", "1", "0"]
    # What the trainer is pinned to is the complement: one core of two, none when the engines cover every core.
    assert engine_cpus(1, [0, 1]) == {0}
    assert engine_cpus(2, [0, 1, 2, 3, 4]) == {0, 1, 2, 3}
    assert engine_cpus(3, [0, 1]) == {0, 1}
