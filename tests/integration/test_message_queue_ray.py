"""The MessageQueue as a real async Ray actor: backpressure, ordering, staleness, snapshot, shutdown, many producers."""

from __future__ import annotations

import time

import pytest

from fully_async.message_queue import QueueClosed, create_message_queue
from fully_async.protocol import PromptRef
from tests.helpers import make_group


def test_backpressure_and_ordering_through_ray(ray_local):
    ray = ray_local
    q = create_message_queue(capacity=4, max_staleness=1)
    ray.get(q.put.remote([make_group(i) for i in range(4)]))
    blocked = q.put.remote([make_group(4)])
    ready, _ = ray.wait([blocked], timeout=0.3)
    assert not ready, "a put into a full queue must wait"
    got = ray.get(q.get.remote(2, 0))
    assert [g.prompt.index for g in got] == [0, 1]
    assert ray.get(blocked, timeout=5) == 3
    got = ray.get(q.get.remote(3, 0))
    assert [g.prompt.index for g in got] == [2, 3, 4]
    assert got[0].same_as(make_group(2))  # arrays survive the trip intact
    ray.kill(q)


def test_stale_filter_reissue_and_snapshot_restore(ray_local):
    ray = ray_local
    q = create_message_queue(capacity=16, max_staleness=1)
    ray.get(q.put.remote([make_group(i, version=v) for i, v in enumerate([0, 3, 1, 2, 3])]))
    got = ray.get(q.get.remote(2, 3))  # versions 0 and 1 are > 1 behind version 3
    assert [g.prompt.index for g in got] == [1, 3]
    snap = ray.get(q.snapshot.remote())
    ray.kill(q)

    q2 = create_message_queue(capacity=16, max_staleness=1)
    assert ray.get(q2.restore.remote(snap)) == 1
    assert ray.get(q2.take_reissue.remote()) == [PromptRef(0, 0), PromptRef(0, 2)]
    stats = ray.get(q2.stats.remote())
    assert stats["dropped_stale"] == 2 and stats["size"] == 1
    assert [g.prompt.index for g in ray.get(q2.get.remote(1, 3))] == [4]
    ray.kill(q2)


def test_close_wakes_blocked_getters_with_a_clear_error(ray_local):
    ray = ray_local
    q = create_message_queue(capacity=2, max_staleness=0)
    getter = q.get.remote(1, 0)
    time.sleep(0.2)
    ray.get(q.close.remote("run stopped by Ctrl-C"))
    with pytest.raises(QueueClosed, match="run stopped by Ctrl-C"):
        ray.get(getter, timeout=5)
    ray.kill(q)


def test_many_producers_lose_and_duplicate_nothing(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    def produce(q, worker, count):
        for i in range(0, count, 5):
            ray.get(q.put.remote([make_group(worker * 1000 + j, epoch=worker) for j in range(i, i + 5)]))
        return count

    q = create_message_queue(capacity=8, max_staleness=0)
    producers = [produce.remote(q, w, 40) for w in range(8)]
    seen = []
    while len(seen) < 8 * 40:
        seen.extend(g.prompt for g in ray.get(q.get.remote(4, 0), timeout=30))
    assert sum(ray.get(producers)) == 320
    assert len(set(seen)) == 320
    # Each producer's own groups arrive in the order it put them.
    for w in range(8):
        mine = [p.index for p in seen if p.epoch == w]
        assert mine == sorted(mine)
    assert ray.get(q.stats.remote())["put_waits"] > 0  # capacity 8 < 320: backpressure did engage
    ray.kill(q)
