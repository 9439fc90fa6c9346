"""What the Rollouter answers about its engine pool (fully_async/engines/service.py), over the emulated engines of
engine=sim: the `fully_async.ctl engines` rows, the min/max limits of add and remove, the pool stats, and which
servers a weight copy or a weight group spans."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
import ray

import fully_async
from fully_async.config import EngineConfig
from fully_async.engines import EngineClient, build_engine
from fully_async.engines.service import EngineService
from fully_async.rollouter import Rollouter
from fully_async.trainer import step_window
from fully_async.weights.port import CALLS

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def service():
    servers = build_engine(EngineConfig(kind="sim", num_servers=3), "/nonexistent", "/tmp")
    client = EngineClient(servers, auto_restart=False)
    yield EngineService(servers, client)
    await client.close()


async def test_rows_say_each_slots_state(service):
    servers = service.servers
    servers.server_died(1)
    servers.slots.mark_stale(2)  # back in rotation at the next sync: the table calls it serving
    rows = await service.rows()
    assert [(r["index"], r["url"], r["state"], r["in_flight"], r["node_id"]) for r in rows] == [
        (0, "sim://engine-0", "serving", 0, None),
        (1, "sim://engine-1", "down", 0, None),
        (2, "sim://engine-2", "serving", 0, None),
    ]
    await service.remove("sim://engine-0", min_servers=1, drain_timeout_s=1.0)
    assert [r["state"] for r in await service.rows()] == ["removed", "down", "serving"]


async def test_add_and_remove_keep_to_the_limits(service):
    with pytest.raises(ValueError, match="passes engine.max_servers=4"):
        await service.add(2, max_servers=4)
    with pytest.raises(ValueError, match="count >= 1"):
        await service.add(0, max_servers=0)
    with pytest.raises(ValueError, match="no engine server at sim://nowhere"):
        await service.remove("sim://nowhere", min_servers=1, drain_timeout_s=1.0)
    out = await service.remove("sim://engine-1", min_servers=2, drain_timeout_s=1.0)
    assert out == {"removed": "sim://engine-1", "moved": 0, "live": 2}
    with pytest.raises(ValueError, match="leaves 1 servers, below engine.min_servers=2"):
        await service.remove("sim://engine-0", min_servers=2, drain_timeout_s=1.0)
    assert service.stats() == {"size": 2, "down": 0, "joins": 0, "leaves": 1, "replacements": 0, "restarts": 0,
                               "join_s": [], "moved": 0}  # fmt: skip


def _window(t: float, busy: list[float], pool: dict) -> dict:
    """A rollouter stats() reading as the trainer's step_window reads it."""
    return {"time": t, "engine_busy_s": busy, "tokens": 0, "groups_failed": 0, "reward_timeouts": 0, "pool": pool}


async def test_a_down_server_leaves_pool_size_and_the_idle_ratio_until_it_serves_again(service):
    servers = service.servers
    before = service.stats()
    assert (before["size"], before["down"]) == (3, 0)
    servers.server_died(1)  # what the client does when a request finds the server dead
    down = service.stats()
    assert (down["size"], down["down"]) == (2, 1)
    # The two serving servers were busy 3 s of a 4 s window; the down one is not counted as an idle engine.
    m = step_window(_window(0.0, [0.0] * 3, before), _window(4.0, [3.0, 0.0, 3.0], down),
                    {"size": 0, "dropped_stale": 0}, 0.0, [])  # fmt: skip
    assert m["fully_async/engines/pool_size"] == 2 and m["fully_async/engines/pool_down"] == 1
    assert m["fully_async/rollouter/idle_ratio"] == pytest.approx(1 - 6.0 / (2 * 4.0))
    await servers.restart_async(1)  # restarted with the current weights: it serves again
    back = service.stats()
    assert (back["size"], back["down"]) == (3, 0)
    servers.slots.mark_stale(2)  # alive on old weights: in the pool, not down
    await service.remove("sim://engine-0", min_servers=1, drain_timeout_s=1.0)  # removed: in neither count
    assert (service.stats()["size"], service.stats()["down"]) == (2, 0)


async def test_a_server_brought_back_in_place_counts_as_a_restart_not_a_replacement():
    servers = build_engine(EngineConfig(kind="sim", num_servers=2), "/nonexistent", "/tmp")
    client = EngineClient(servers, auto_restart=True)
    service = EngineService(servers, client)
    before = service.stats()
    client.recovery.schedule_restart(1)  # what a sync does with a server it set aside (hung, or found dead)
    for _ in range(200):
        if service.stats()["size"] == 2:
            break
        await asyncio.sleep(0.01)
    after = service.stats()
    assert (after["size"], after["restarts"], after["replacements"]) == (2, 1, 0)
    m = step_window(_window(0.0, [0.0] * 2, before), _window(1.0, [0.0] * 2, after), {"size": 0, "dropped_stale": 0},
                    0.0, [])  # fmt: skip
    assert m["fully_async/count/engine_restarts"] == 1 and m["fully_async/count/engine_replacements"] == 0
    await client.close()


async def test_weights_reach_the_servers_in_the_pool_that_are_not_down(service):
    servers = service.servers
    servers.server_died(0)
    servers.slots.mark_stale(1)  # the sync must reach it
    await service.remove("sim://engine-2", min_servers=1, drain_timeout_s=1.0)
    # a child server of this process runs on this process's node: None without Ray, the node's id when an earlier
    # test in the session left Ray up
    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    assert [n["node_id"] for n in service.nodes()] == [here]
    assert [s["index"] for s in service.layout()["servers"]] == [1]


async def test_the_port_answers_its_calls_tells_the_rollouter_of_syncs_and_refuses_others(tmp_path):
    servers = build_engine(EngineConfig(kind="sim", num_servers=2, min_servers=1), "/nonexistent", "/tmp")
    client = EngineClient(servers, auto_restart=False)
    synced: list[tuple[int, bool]] = []
    port = EngineService(servers, client, synced=lambda version, serving: synced.append((version, serving)))
    try:
        assert await port.call("control_deadline_s") == servers.cfg.control_deadline_s
        assert await port.call("unverifiable") == "engine=sim holds no weights"
        await port.call("load_weights", str(tmp_path), 3)
        assert servers.state.version == 3 and synced == [(3, False)]  # a reload serves from the resume on
        await port.call("weights_received", 4, servers.weights.epoch)
        assert servers.state.version == 4 and synced == [(3, False), (4, False)]
        assert (await port.call("remove", "sim://engine-1"))["live"] == 1  # engine.min_servers=1 from the config
        with pytest.raises(ValueError, match="engine.min_servers=1"):
            await port.call("remove", "sim://engine-0")
        with pytest.raises(ValueError, match="no call 'stop'"):
            await port.call("stop")  # the pool's lifetime is the Rollouter's, not the port's
    finally:
        await client.close()


def _rollouter_calls_in(path) -> tuple[set[str], set[str], bool]:
    """(methods called on a rollouter handle, engine port methods used, whether it sends an engine call by name) in
    one module of ours."""
    methods, calls, by_name = set(), set(), False
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func.endswith(".remote") and func.rsplit(".", 2)[0].endswith("rollouter"):
                methods.add(func.rsplit(".", 2)[1])  # rollouter.<method>.remote(...)
                by_name |= func.rsplit(".", 2)[1] == "engine"
        elif isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if owner.endswith(".engines") or owner.startswith("EnginePort("):
                calls.add(node.attr)  # self.engines.<call>, EnginePort(handle).<call>
    return methods, calls, by_name


def test_every_call_a_transport_or_ctl_sends_the_rollouter_is_its_own_or_a_typed_port_call():
    root = Path(fully_async.__file__).parent
    methods, calls, senders = set(), set(), []
    for path in [*root.glob("weights/*.py"), *root.glob("sync/*.py"), root / "ctl.py"]:
        m, c, by_name = _rollouter_calls_in(path)
        methods |= m
        calls |= c
        if by_name:
            senders.append(path.relative_to(root).as_posix())
    assert {"engine", "pause", "resume", "diagnose"} <= methods
    assert {"load_weights", "nodes", "rpc", "layout", "rows", "add", "remove"} <= calls
    public = {n for n in vars(Rollouter) if not n.startswith("_")}
    assert methods <= public, f"calls to no Rollouter method: {sorted(methods - public)}"
    assert calls <= CALLS, f"engine port calls that do not exist: {sorted(calls - CALLS)}"
    assert senders == ["weights/port.py"], "an engine call sent by name, not through weights/port.py's EnginePort"
    assert not public & ({f"engine_{n}" for n in CALLS} | CALLS)  # the port's calls are no Rollouter pass-throughs
