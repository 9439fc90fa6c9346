"""One state per engine server slot (fully_async/engines/slots.py) and the pool's moves between them
(fully_async/engines/pool.py, elastic.py), with the emulated engines of engine=sim: a slot serves, goes down when its
server dies and serves again once restarted; it goes stale when it comes back on weights the pool cannot give it and
serves again at the next sync that reaches it; a removed slot is retired for good."""

from __future__ import annotations

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import EngineClient, build_engine
from fully_async.engines.slots import Slots, SlotState

pytestmark = pytest.mark.timeout(60)

S = SlotState


def sim_pool(num_servers: int = 3):
    return build_engine(EngineConfig(kind="sim", num_servers=num_servers), "/nonexistent", "/tmp")


def test_counts_follow_every_move_and_retired_is_final():
    slots = Slots(3)
    assert slots.all_serving and slots.count(S.SERVING) == 3
    slots.mark_down(0)
    slots.mark_stale(1)
    assert not slots.all_serving
    assert [slots.count(s) for s in S] == [1, 1, 1, 0]
    assert slots.indices(S.SERVING, S.STALE) == [1, 2] and slots.of(S.DOWN) == {0}
    slots.retire(0)
    slots.mark_down(0)  # a late death report of a removed server
    slots.back_up(0, stale=False)
    assert slots[0] is S.RETIRED and slots.count(S.DOWN) == 0 and slots.count(S.RETIRED) == 1
    assert slots.append() == 3 and slots.count(S.SERVING) == 2 and len(slots) == 4


def test_back_up_moves_only_a_down_slot():
    slots = Slots(3)
    slots.mark_down(0)
    slots.mark_down(1)
    slots.mark_stale(2)
    slots.back_up(0, stale=False)
    slots.back_up(1, stale=True)  # came back on weights the pool could not give it
    slots.back_up(2, stale=False)  # a stale server restarted stays stale until a sync reaches it
    assert [slots[i] for i in range(3)] == [S.SERVING, S.STALE, S.STALE]
    slots.sync_reached()
    assert slots.all_serving


async def test_a_server_that_died_is_down_until_restarted_then_serves():
    pool = sim_pool()
    client = EngineClient(pool, auto_restart=False)
    dead: list[int] = []
    pool.on_dead = dead.append
    pool.server_died(1)
    assert dead == [1] and pool.down == {1} and client.down == {1}
    assert pool.serving == [0, 2] and pool.live == [0, 1, 2]
    assert {client.pick() for _ in range(6)} == {0, 2}  # out of rotation
    await pool.restart_async(1)
    assert pool.slots[1] is S.SERVING and pool.down == frozenset() and pool.serving == [0, 1, 2]
    await client.close()


async def test_a_removed_server_is_retired_and_never_picked_again():
    pool = sim_pool()
    client = EngineClient(pool)
    epoch = pool.weights.epoch
    moved = await client.remove_server(0, drain_timeout_s=1.0)
    assert moved == 0 and pool.slots[0] is S.RETIRED and client.retired == {0} and pool.weights.epoch == epoch + 1
    assert pool.live == [1, 2] and pool.layout()["servers"] == [
        {"index": i, "url": pool.address(i), "workers": 1} for i in (1, 2)
    ]
    assert {client.pick() for _ in range(6)} == {1, 2}
    pool.server_died(0)  # a removed server reported dead later changes nothing
    assert pool.slots[0] is S.RETIRED and pool.down == frozenset()
    assert ("leave", 0, "sim://engine-0", None) in pool.pool_events
    await client.close()


async def test_the_pool_retires_a_server_it_removes_on_its_own():
    pool = sim_pool(2)
    epoch = pool.weights.epoch
    await pool.remove(1)  # no client in front: the pool itself takes it out of rotation and of the weight group
    assert pool.slots[1] is S.RETIRED and pool.live == [0] and pool.weights.epoch == epoch + 1


async def test_a_stale_server_gets_the_next_sync_and_serves_again():
    pool = sim_pool(2)
    pool.slots.mark_stale(1)
    assert pool.serving == [0, 1] and pool.routed_urls() == [pool.address(0)]
    await pool.weights_received(1, pool.weights.epoch - 1)  # a weight group formed before it came back: still stale
    assert pool.stale == {1}
    await pool.load_weights("/tmp", 2)  # a disk sync reloads every serving server, stale ones included
    assert pool.stale == frozenset() and [e.version for e in pool.kind.engines] == [2, 2]
    assert pool.kind.engines[1].reloads == ["/tmp"]


async def test_a_dead_server_back_on_old_weights_is_stale_until_a_group_formed_after_its_return_reaches_it(tmp_path):
    import asyncio

    from fully_async.engines.elastic import bring_current, came_back
    from tests.fakes import FakeEngine

    fakes = [await FakeEngine().start() for _ in range(2)]
    pool = build_engine(EngineConfig(control_timeout_s=5.0), "/nonexistent", tmp_path, addresses=[f.url for f in fakes])
    try:
        await pool.weights_received(2, pool.weights.epoch)  # a collective sync: version 2 exists in no directory
        pool.server_died(1)
        await pool.restart_async(1)
        assert pool.slots[1] is S.STALE and fakes[1].version == "2"  # labelled, but on its start-up weights
        pool.server_died(1)
        # restart_async step by step, with the next sync's weight group formed while the server is still down
        await asyncio.to_thread(pool.relaunch, 1)
        layout = pool.layout(pool.down)
        async with pool.membership:
            await bring_current(pool, [1])
            came_back(pool, 1)
        await pool.weights_received(3, layout["epoch"])  # that group never reached it
        assert pool.stale == {1}
        await pool.weights_received(4, pool.layout(pool.down)["epoch"])  # a group formed after its return
        assert pool.stale == frozenset() and pool.serving == [0, 1]
    finally:
        for f in fakes:
            await f.stop()
