"""What the Rollouter answers about its engine pool (fully_async/engines/service.py), over the emulated engines of
engine=sim: the `fully_async.ctl engines` rows, the min/max limits of add and remove, the pool stats, and which
servers a weight copy or a weight group spans."""

from __future__ import annotations

import pytest
import ray

from fully_async.config import EngineConfig
from fully_async.engines import EngineClient, build_engine
from fully_async.engines.service import EngineService

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
    assert service.stats() == {"size": 2, "joins": 0, "leaves": 1, "replacements": 0, "join_s": [], "moved": 0}


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
