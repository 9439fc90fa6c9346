"""The elastic engine pool (fully_async/engines/base.py add/remove/relaunch, client.py retire/remove_server,
engines/host.py HostFactory) with real server processes: the fake engine of tests/fakes.py run as child processes
or under Ray-placed EngineHost actors, so the launch, watchdog, host and placement paths are the real ones.

- a server added mid-run holds the current weights and version before the client sends it anything;
- a server removed with requests in flight: they finish on the others, budget and versions kept, nothing lost;
- a server whose engine host is gone (its node lost) is replaced by a new host in a new placement group.

The same with vLLM-CPU on a multi-node cluster, driven by `python -m fully_async.ctl`, is
tests/integration/test_elastic_cluster.py."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest

from fully_async.config import EngineConfig, compose
from fully_async.engines import EngineClient
from fully_async.engines.process import SHM, shm_record
from tests.fakes import FakeProcessServers

pytestmark = pytest.mark.timeout(180)


async def _state(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/fake_state") as resp:
        return await resp.json()


class SlowFakes(FakeProcessServers):
    token_delay_s = 0.02


async def test_an_added_server_serves_only_with_the_current_weights_and_version(tmp_path):
    servers = FakeProcessServers(EngineConfig(startup_timeout_s=30.0), tmp_path, tmp_path)
    await asyncio.to_thread(servers.start)
    try:
        client = EngineClient(servers)
        await servers.pause("abort")
        await servers.load_weights(tmp_path, 3)
        await servers.resume()
        (index,) = await servers.add(1)
        assert index == 1 and servers.live == [0, 1]
        new = servers.address(1)
        state = await _state(new)
        # Before its first request: the weights the others hold, labelled with their version.
        assert state["prompts"] == 0 and state["version"] == "3" and state["reloads"] == [str(tmp_path.resolve())]
        results = await asyncio.gather(*(client.generate([1, i], 4) for i in range(4)))
        assert {r.servers[0] for r in results} == {servers.address(0), new}  # the client balanced onto it
        assert all(r.versions == [3] * 4 for r in results)
        assert servers.pool_events == [("join", 1, new, None)]
        await client.close()
    finally:
        servers.stop()


async def test_a_server_added_during_a_sync_stays_paused_until_the_resume(tmp_path):
    servers = FakeProcessServers(EngineConfig(startup_timeout_s=30.0), tmp_path, tmp_path)
    await asyncio.to_thread(servers.start)
    try:
        await servers.pause("abort")
        (index,) = await servers.add(1)
        assert await servers.is_paused(servers.address(index))  # joined paused, like the others
        await servers.load_weights(tmp_path, 1)  # the sync goes on: the new server is reloaded with the rest
        await servers.resume()
        state = await _state(servers.address(index))
        assert state["version"] == "1" and not await servers.is_paused(servers.address(index))
    finally:
        servers.stop()


@pytest.mark.parametrize("partial_rollout", [True, False])
async def test_a_removed_server_moves_its_requests_to_the_others(tmp_path, partial_rollout):
    cfg = EngineConfig(num_servers=2, startup_timeout_s=30.0)
    servers = SlowFakes(cfg, tmp_path, tmp_path)
    await asyncio.to_thread(servers.start)
    try:
        await servers.set_version(2)
        client = EngineClient(servers)
        gone = servers.address(0)
        budget = 40  # 0.8 s per request at 20 ms per token
        jobs = [
            asyncio.create_task(client.generate([7, i], budget, continue_on_abort=partial_rollout)) for i in range(6)
        ]
        await asyncio.sleep(0.3)
        assert client.outstanding[0] > 0  # requests in flight on the server we remove
        moved = await client.remove_server(0, drain_timeout_s=10.0)
        results = await asyncio.gather(*jobs)
        assert moved >= 1 and client.stats.moved == moved
        for r in results:  # nothing lost: every request got its whole budget
            assert len(r.token_ids) == budget and r.versions == [2] * budget
        on_removed = [r for r in results if r.servers[0] == gone]
        assert len(on_removed) == moved
        for r in on_removed:
            assert r.servers[-1] != gone and r.num_aborts == 1
        after = await asyncio.gather(*(client.generate([9, i], 3) for i in range(4)))
        assert all(r.servers == [servers.address(1)] and r.num_retries == 0 for r in after)  # never picked again
        assert servers.live == [1] and not servers.is_alive(0)
        assert ("leave", 0, gone, None) in servers.pool_events
        await client.close()
    finally:
        servers.stop()


async def test_a_server_whose_host_is_gone_is_replaced_in_a_new_placement_group(ray_local, tmp_path):
    import ray

    from fully_async.engines.host import HostFactory

    cfg = compose(["engine.startup_timeout_s=30", "placement.engine_cpus=0.01"])
    node = ray.get_runtime_context().get_node_id()
    factory = HostFactory(cfg, str(tmp_path), node, None, None, gpu=False)
    first = factory.create(0)
    servers = FakeProcessServers(cfg.engine, tmp_path, tmp_path, hosts=[first])
    servers.host_factory = factory
    servers.mode = "shm"  # each server holds a /dev/shm segment that only its own clean shutdown would remove
    await asyncio.to_thread(servers.start)
    record = shm_record(servers.log_path(0))
    segments = [[e["name"] for e in json.loads(record.read_text())]]
    try:
        client = EngineClient(servers, auto_restart=True, max_retries=3)
        await servers.load_weights(tmp_path, 5)  # from a directory: what a replacement reloads
        old_url, old_group = servers.address(0), factory.groups[0]
        old_pid = ray.get(first.where.remote())["server_pid"]
        ray.kill(first, no_restart=True)  # what a lost node does to its actors (the server dies with its host)
        for _ in range(200):  # ray.kill returns at once; the server goes when the watchdog sees its host gone
            if _gone(old_pid):
                break
            await asyncio.sleep(0.05)
        out = await client.generate([1, 2], 4)  # fails on the dead server, waits for the replacement, then serves
        assert out.versions == [5] * 4 and out.servers[-1] == servers.address(0) != old_url
        assert client.stats.restarts == 1 and client.down == set()
        assert factory.groups[0] is not old_group and ray.util.placement_group_table(old_group)["state"] == "REMOVED"
        assert ("replace", 0, old_url, servers.address(0)) in servers.pool_events
        # The lost server's segment went when its replacement launched (on the same machine, under the same log).
        segments.append([e["name"] for e in json.loads(record.read_text())])
        assert segments[0] and segments[1] and not set(segments[0]) & set(segments[1])
        assert not any((SHM / name).exists() for name in segments[0])
        await client.close()
    finally:
        servers.stop()
    assert factory.groups == {}  # stop() released the groups the factory reserved
    assert not any((SHM / name).exists() for names in segments for name in names) and not record.exists()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_server_added_when_the_weights_are_in_no_directory_waits_for_the_next_sync(tmp_path):
    # The collective transport leaves the current weights in no directory: a new server cannot load them, so it stays
    # out of rotation (stale) and the pool's epoch changes, so the next sync re-forms the weight group with it.
    servers = FakeProcessServers(EngineConfig(startup_timeout_s=30.0), tmp_path, tmp_path)
    await asyncio.to_thread(servers.start)
    try:
        client = EngineClient(servers)
        await servers.weights_received(2, servers.weights.epoch)  # a collective sync: version 2, no directory
        epoch = servers.weights.epoch
        (index,) = await servers.add(1)
        assert servers.stale == {index} and servers.weights.epoch == epoch + 1
        results = await asyncio.gather(*(client.generate([3, i], 2) for i in range(4)))
        assert all(r.servers == [servers.address(0)] for r in results)  # never the stale one
        await servers.weights_received(3, servers.weights.epoch)  # the next sync reached it
        assert servers.stale == set()
        await client.close()
    finally:
        servers.stop()


async def test_a_sync_goes_on_without_a_server_that_died_under_it_and_the_server_comes_back_current(tmp_path):
    servers = FakeProcessServers(EngineConfig(num_servers=2, startup_timeout_s=30.0), tmp_path, tmp_path)
    await asyncio.to_thread(servers.start)
    try:
        client = EngineClient(servers, auto_restart=True)
        os.killpg(servers.procs[0].popen.pid, 9)  # dies between two requests: nobody has noticed yet
        for _ in range(200):
            if not servers.is_alive(0):
                break
            await asyncio.sleep(0.05)
        await servers.pause("abort")  # the sync: completes for the other server
        await servers.load_weights(tmp_path, 2)
        await servers.resume()
        assert servers.down == {0} and servers.serving == [1]
        assert (await _state(servers.address(1)))["version"] == "2"
        for _ in range(400):  # the control plane handed it to the client, which restarts it
            if not client.down:
                break
            await asyncio.sleep(0.05)
        assert client.down == set() and client.stats.restarts == 1
        state = await _state(servers.address(0))
        assert state["version"] == "2" and state["reloads"] == [str(tmp_path.resolve())]  # current before serving
        await client.close()
    finally:
        servers.stop()


@pytest.mark.parametrize("on_sync", ["recompute", "keep"])
async def test_a_server_killed_while_its_request_is_frozen_loses_it_to_the_retry_and_nothing_else(tmp_path, on_sync):
    """async_training.on_sync freezes a request on server 0; server 0 is SIGKILLed during the sync. The frozen tokens
    never reached the client: the request is sent again to server 1 from where the client last had it (the retry
    path), after the resume, and finishes with its whole budget at the new version; nothing is counted twice."""
    servers = FakeProcessServers(EngineConfig(num_servers=2, startup_timeout_s=30.0), tmp_path, tmp_path)
    servers.token_delay_s = 0.01
    await asyncio.to_thread(servers.start)
    try:
        servers.state.on_sync = on_sync
        client = EngineClient(servers, auto_restart=False)
        await servers.set_version(2)
        task = asyncio.create_task(client.generate([7, 1], 40))
        while client.outstanding[0] + client.outstanding[1] == 0:
            await asyncio.sleep(0.005)
        victim = 0 if client.outstanding[0] else 1
        await asyncio.sleep(0.1)
        assert await servers.pause(on_sync)
        await asyncio.sleep(0.2)  # an aborted request's answer would be back by now: a frozen one never comes
        assert not task.done()
        os.killpg(servers.procs[victim].popen.pid, 9)
        await servers.set_version(3)
        await servers.resume()
        out = await asyncio.wait_for(task, 30)
        assert len(out.token_ids) == 40 and out.num_retries == 1 and out.num_aborts == 0
        assert list(out.versions) == [3] * 40 and out.servers == [servers.address(1 - victim)]
        assert client.stats.frozen_requests == 0 and client.stats.engine_reprefill_tokens == 0
        await client.close()
    finally:
        servers.stop()


def test_launch_does_not_wait_and_start_then_waits_for_the_same_processes(tmp_path):
    # The rollouter launches its servers before it loads the tokenizer (start-up's critical path), then waits in
    # `start`: `launch` returns while no server answers yet, and neither a second `launch` nor `start` launches more.
    waiting = FakeProcessServers(EngineConfig(startup_timeout_s=2.0), tmp_path / "never", tmp_path / "never")
    waiting.mode = "never_healthy"
    try:
        waiting.launch()  # returns although the server never answers /health (start would raise after 2 s)
        assert waiting.procs[0].is_alive() and not waiting.procs[0].healthy(timeout=0.5)
    finally:
        waiting.stop()
    servers = FakeProcessServers(EngineConfig(startup_timeout_s=30.0), tmp_path, tmp_path)
    try:
        servers.launch()
        pid, (begun, _) = servers.procs[0].popen.pid, servers.started_at["engine_launch"]
        servers.launch()
        servers.start()  # would raise "already running" if it launched again
        assert servers.procs[0].popen.pid == pid and servers.procs[0].healthy()
        assert servers.started_at["engine_launch"][0] == begun < servers.started_at["engine_launch"][1]
    finally:
        servers.stop()
