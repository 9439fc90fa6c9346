"""Sticky routing (fully_async/engines/affinity.py) on the real EngineClient's balancer: a session stays on its home
server and moves only when that server leaves the pool, is set aside or down, comes back stale, or fails the request;
homes are bounded; first calls are balanced; requests without a session are balanced per request as before."""

from __future__ import annotations

import asyncio

import pytest

from fully_async.config import EngineConfig, SimEngineConfig
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.engines.affinity import Affinity, keyed, metrics, session
from fully_async.engines.slots import SlotState
from fully_async.production import sample_id

pytestmark = pytest.mark.timeout(60)


def make(n: int) -> EngineClient:
    cfg = EngineConfig(control_timeout_s=5.0)
    return EngineClient(build_engine(cfg, "/nonexistent", "/tmp", addresses=[f"http://s{i}" for i in range(n)]))


def pick(client: EngineClient, key: str, exclude: int | None = None) -> int:
    with keyed(key):
        return client.affinity.pick(client, exclude)


def test_a_session_stays_home_whatever_the_load_and_moves_only_when_its_server_cannot_serve():
    client = make(3)
    slots = client.servers.slots
    home = pick(client, "ep")
    client.outstanding[home] = 50  # busy: a per-request balancer would go elsewhere
    assert [pick(client, "ep") for _ in range(5)] == [home] * 5
    for leave in (slots.mark_down, slots.mark_stale, slots.retire):  # set aside or died; stale; left the pool
        client.outstanding[:] = [0] * 3
        client.outstanding[home] = 50
        leave(home)
        old, home = home, pick(client, "ep")
        assert home != old and pick(client, "ep") == home
        if leave is not slots.retire:
            slots.set(old, SlotState.SERVING)  # back in rotation: the session does not move back
            assert pick(client, "ep") == home
    assert pick(client, "ep", exclude=home) != home  # the request just failed there: retried and re-homed elsewhere
    assert client.affinity.counts()["moved"] == 4 and client.affinity.counts()["homed"] == 1


def test_step_metrics_share_the_keyed_requests_that_stayed_home_and_count_the_moves():
    client = make(2)
    assert metrics(client.affinity.counts(), {}) == {}  # no keyed request yet: no metric, not a ratio of 0
    pick(client, "a"), pick(client, "b")  # two first calls
    before = client.affinity.counts()
    home = pick(client, "a")
    for _ in range(2):
        pick(client, "a"), pick(client, "b")
    client.servers.slots.mark_down(home)
    pick(client, "a")  # moves
    pick(client, "c")  # a first call: a keyed request that had no home to stay at
    with keyed(""):
        client.affinity.pick(client)  # a request of no episode is not counted
    m = metrics(client.affinity.counts(), before)
    assert m == {"fully_async/routing/stayed_ratio": 5 / 7, "fully_async/routing/sessions_moved": 1.0}
    assert metrics(before, before) == {}


def test_homes_are_bounded_least_recently_used_first():
    affinity = Affinity(capacity=3)
    client = make(2)
    client.affinity = affinity
    for key in ("a", "b", "c"):
        pick(client, key)
    pick(client, "a")  # used again: "b" is now the oldest
    pick(client, "d")
    assert len(affinity) == 3 and affinity.home("b") is None
    assert all(affinity.home(k) is not None for k in ("a", "c", "d"))
    with pytest.raises(ValueError, match="capacity"):
        Affinity(capacity=0)


def test_first_calls_go_to_the_least_loaded_server_so_sessions_spread():
    client = make(2)
    homes = []
    for k in range(10):  # each session's first request stays in flight while the next session starts
        idx = pick(client, f"s{k}")
        client.outstanding[idx] += 1
        homes.append(idx)
    assert homes.count(0) == homes.count(1) == 5
    client.outstanding[:] = [6, 0]  # server 0's sessions are generating, server 1's are in their tools
    fresh = [pick(client, f"new{k}") for k in range(3)]
    assert fresh == [1, 1, 1]


def test_requests_without_a_session_are_balanced_per_request():
    client = make(3)
    assert session.get() == ""
    assert [client.affinity.pick(client) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert len(client.affinity) == 0


async def test_each_sample_keeps_its_requests_on_one_sim_server():
    """Production's `sample_id` is the session key: concurrent samples of 3 turns each on 2 emulated servers."""
    sim = SimEngineConfig(decode_step_s=0.001, decode_step_per_seq_s=0.0, length_sigma=0.0, length_median=1000.0)
    servers = build_engine(EngineConfig(kind="sim", num_servers=2, sim=sim), "/nonexistent", "/tmp")
    servers.start()
    client = EngineClient(servers)
    seen: dict[str, list[int]] = {}
    client.on_segment = lambda idx, *_: seen.setdefault(sample_id.get(), []).append(idx)

    async def episode(k: int) -> None:
        sample_id.set(f"p{k}/0")
        prompt = [1, 2, 3]
        for _ in range(3):
            out = await client.generate(prompt, 5 + k, Sampling())
            prompt = prompt + list(out.token_ids) + [7]
            await asyncio.sleep(0.001 * k)  # a tool call of its own length

    await asyncio.gather(*(episode(k) for k in range(8)))
    await client.close()
    assert len(seen) == 8 and all(len(v) == 3 and len(set(v)) == 1 for v in seen.values()), seen
    assert sorted(v[0] for v in seen.values()).count(0) == 4  # and the sessions split evenly
