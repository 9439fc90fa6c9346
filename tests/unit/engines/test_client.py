"""EngineClient logic against fake engines at the HTTP edge: balancing, budget arithmetic across aborts, per-token
versions, retries and error messages. The real vLLM server is exercised in tests/integration/test_engine_servers.py (vLLM and SGLang)."""

from __future__ import annotations

import asyncio

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import EngineClient, EngineError, Sampling, build_engine
from tests.fakes import FakeEngine
from tests.helpers import generate_across_a_sync

pytestmark = pytest.mark.timeout(60)


def make(urls: list[str], **cfg) -> EngineClient:
    servers = build_engine(EngineConfig(**{"control_timeout_s": 5.0, **cfg}), "/nonexistent", "/tmp", addresses=urls)
    return EngineClient(servers)


@pytest.fixture
async def fakes():
    started: list[FakeEngine] = []

    async def factory(**kw) -> FakeEngine:
        fake = await FakeEngine(**kw).start()
        started.append(fake)
        return fake

    yield factory
    for fake in started:
        await fake.stop()


def test_pick_prefers_least_outstanding_and_skips_down_servers():
    client = make(["http://a", "http://b", "http://c"])
    client.outstanding[:] = [3, 1, 2]
    assert client.pick() == 1
    assert client.pick(exclude=1) == 2
    client.servers.slots.mark_down(2)
    assert client.pick(exclude=1) == 0
    for i in (0, 1):
        client.servers.slots.mark_down(i)
    assert client.pick() in {0, 1, 2}  # all down: still answers (the send then fails and is counted)


def test_pick_never_sends_to_a_stale_server_even_as_the_last_resort():
    """A server restarted on old weights (collective transport) waits for the next sync out of rotation."""
    client = make(["http://a", "http://b", "http://c"])
    client.outstanding[:] = [3, 1, 2]
    client.servers.slots.mark_stale(1)
    assert client.pick() == 2
    assert {client.pick(exclude=2) for _ in range(3)} == {0}
    for i in (0, 2):
        client.servers.slots.mark_down(i)
    assert client.pick() in {0, 2}  # down ones before a stale one
    for i in (0, 2):
        client.servers.slots.mark_stale(i)
    with pytest.raises(EngineError, match="every engine server is waiting for the next weight sync"):
        client.pick()


def test_pick_rotates_between_ties():
    client = make(["http://a", "http://b", "http://c"])
    assert [client.pick() for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_pick_fast_path_agrees_with_the_general_one():
    import random

    rng = random.Random(0)
    fast, general = make([f"http://s{i}" for i in range(7)]), make([f"http://s{i}" for i in range(8)])
    general.servers.retire(7)  # a server removed from the pool: forces the general path, changes nothing else
    for _ in range(500):
        load = [rng.randrange(3) for _ in range(7)]
        fast.outstanding[:], general.outstanding[:] = load, [*load, 0]
        assert fast.pick() == general.pick()


async def test_generate_returns_tokens_logprobs_and_engine_versions(fakes):
    fake = await fakes()
    client = make([fake.url])
    await client.servers.set_version(3)
    prompt = [5, 6, 7]
    out = await client.generate(prompt, 9)
    await client.close()
    expected = [(sum(prompt) + i) % 250 for i in range(9)]
    assert out.token_ids == expected
    assert out.logprobs == [-(t % 7) - 0.5 for t in expected]
    assert out.versions == [3] * 9
    assert out.finish_reason == "length" and out.start_version == 3
    assert out.num_aborts == out.num_retries == 0


async def test_stop_token_ends_the_sample(fakes):
    fake = await fakes(stop_token=22)
    client = make([fake.url])
    out = await client.generate([20], 10)
    await client.close()
    assert out.token_ids == [20, 21, 22] and out.finish_reason == "stop"
    assert fake.prompts == [[20]]


async def test_versions_fall_back_to_the_control_plane_when_the_engine_reports_none(fakes):
    fake = await fakes()  # its label stays "default" unless set through it
    client = make([fake.url])
    client.servers.state.version = 4
    out = await client.generate([1], 3)
    await client.close()
    assert out.versions == [4, 4, 4]


@pytest.mark.parametrize("pause_after_s", [0.0, 0.05, 0.12])
async def test_abort_continue_keeps_budget_and_splits_versions(fakes, tmp_path, pause_after_s):
    fake = await fakes(token_delay_s=0.01)
    client = make([fake.url])
    servers = client.servers
    prompt, budget = [1, 2, 3], 30
    out = await generate_across_a_sync(client, tmp_path, prompt, budget, pause_after_s)
    await client.close()
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == budget
    assert out.num_aborts == 1 and out.finish_reason == "length"
    k = out.versions.count(0)
    assert out.versions == [0] * k + [1] * (budget - k)
    assert client.stats.carried_tokens == k
    # The continuation was sent as prompt + tokens so far with the remaining budget.
    assert fake.prompts[-1] == prompt + out.token_ids[:k]
    assert fake.reloads == [str(tmp_path.resolve())]
    assert servers.state.version == 1 and servers.weights.directory == tmp_path.resolve()


async def test_a_pause_that_meets_no_request_in_flight_holds_only_the_client_and_a_new_request_waits(fakes, tmp_path):
    fake = await fakes(token_delay_s=0.01)
    client = make([fake.url])
    servers = client.servers
    await servers.set_version(0)
    assert client.idle()
    assert await servers.pause("abort", idle=client.idle) is False
    assert not fake.paused  # nothing ran to abort: the server was not called
    task = asyncio.create_task(client.generate([5], 6))
    await asyncio.sleep(0.1)
    assert not task.done() and fake.generate_calls == 0  # held by the client until the resume
    await servers.load_weights(tmp_path, 1)
    await servers.resume()
    out = await asyncio.wait_for(task, 5)
    await client.close()
    assert out.versions == [1] * 6 and out.num_aborts == 0 and fake.reloads == [str(tmp_path.resolve())]


async def test_a_pause_that_meets_a_request_in_flight_pauses_the_servers_and_it_continues_after(fakes, tmp_path):
    fake = await fakes(token_delay_s=0.01)
    client = make([fake.url])
    servers = client.servers
    await servers.set_version(0)
    task = asyncio.create_task(client.generate([5], 30))
    while not fake.prompts:  # until the server generates it
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert not client.idle()
    assert await servers.pause("abort", idle=client.idle) is True
    assert fake.paused
    await asyncio.sleep(0.05)  # the fake sees the pause between two tokens
    await servers.load_weights(tmp_path, 1)
    await servers.resume()
    out = await asyncio.wait_for(task, 5)
    await client.close()
    k = out.versions.count(0)
    assert 0 < k < 30
    assert out.versions == [0] * k + [1] * (30 - k) and out.num_aborts == 1 and not fake.paused


async def test_abort_from_a_control_plane_elsewhere_waits_for_the_server_to_resume(fakes):
    fake = await fakes(token_delay_s=0.01)
    client = make([fake.url])
    task = asyncio.create_task(client.generate([9], 20))
    await asyncio.sleep(0.05)
    fake.paused = True  # paused by another process: this client's state knows nothing
    fake._resume_event.clear()
    await asyncio.sleep(0.3)
    assert not task.done()
    fake.paused = False
    fake._resume_event.set()
    out = await asyncio.wait_for(task, 5)
    await client.close()
    assert len(out.token_ids) == 20 and out.num_aborts == 1
    assert client.stats.aborts == 1


async def test_segment_outliving_a_version_change_keeps_the_engines_per_token_labels(fakes):
    fake = await fakes(token_delay_s=0.01)
    client = make([fake.url])
    await client.servers.set_version(2)
    task = asyncio.create_task(client.generate([9], 20))
    await asyncio.sleep(0.05)
    await client.servers.set_version(3)  # not paused: the in-flight request is not aborted; the engine labels the rest
    out = await task
    await client.close()
    k = out.versions.count(2)
    assert 0 < k < 20 and out.versions == [2] * k + [3] * (20 - k) and out.num_aborts == 0
    assert client.stats.frozen_requests == 1  # it outlived a version change


async def test_pause_longer_than_resume_timeout_fails_clearly(fakes):
    fake = await fakes(token_delay_s=0.01)
    client = make([fake.url], resume_timeout_s=0.3)
    task = asyncio.create_task(client.generate([9], 50))
    await asyncio.sleep(0.05)
    await client.servers.pause("abort")
    with pytest.raises(EngineError, match="resume_timeout_s"):
        await task
    await client.close()


async def test_concurrent_requests_are_balanced(fakes):
    a, b = await fakes(token_delay_s=0.005), await fakes(token_delay_s=0.005)
    client = make([a.url, b.url])
    outs = await asyncio.gather(*(client.generate([i], 10) for i in range(20)))
    await client.close()
    assert all(len(o.token_ids) == 10 for o in outs)
    assert a.generate_calls == b.generate_calls == 10
    assert client.outstanding == [0, 0]


async def test_transient_5xx_is_retried_and_counted(fakes):
    fake = await fakes(mode="fail_first", fail_count=2)
    client = make([fake.url], max_retries=2)
    out = await client.generate([1], 4)
    await client.close()
    assert len(out.token_ids) == 4
    assert out.num_retries == 2 and client.stats.retries == 2 and fake.generate_calls == 3


async def test_failed_server_is_avoided_on_retry(fakes):
    bad, good = await fakes(mode="5xx"), await fakes()
    client = make([bad.url, good.url], max_retries=1)
    out = await client.generate([1], 4)
    await client.close()
    assert out.servers == [good.url] and out.num_retries == 1
    assert bad.generate_calls == 1


@pytest.mark.parametrize("mode,reason", [("5xx", "HTTP 500"), ("malformed", "malformed"), ("bad_shape", "malformed")])
async def test_persistent_failure_raises_naming_server_after_retry_budget(fakes, mode, reason):
    fake = await fakes(mode=mode)
    client = make([fake.url], max_retries=2)
    with pytest.raises(EngineError, match=reason) as err:
        await client.generate([1], 4)
    await client.close()
    assert fake.url in str(err.value) and "engine.max_retries=2" in str(err.value)
    assert fake.generate_calls == 3 and client.stats.retries == 3


async def test_request_timeout_is_a_retryable_failure(fakes):
    fake = await fakes(token_delay_s=0.5)
    client = make([fake.url], max_retries=0, request_timeout_s=0.2)
    with pytest.raises(EngineError, match="request_timeout_s"):
        await client.generate([1], 10)
    await client.close()


async def test_unreachable_server_fails_fast_with_its_url():
    client = make(["http://127.0.0.1:9"], max_retries=1)
    with pytest.raises(EngineError, match=r"127\.0\.0\.1:9"):
        await asyncio.wait_for(client.generate([1], 4), 10)
    await client.close()


async def test_control_plane_reports_each_failed_server(fakes):
    fake = await fakes()
    client = make([fake.url, "http://127.0.0.1:9"])
    with pytest.raises(EngineError, match=r"pause failed on 1 of 2 servers: http://127\.0\.0\.1:9"):
        await client.servers.pause("abort")
    assert fake.paused  # the reachable one was still paused
    await client.close()


def test_sampling_from_rollout_config():
    from fully_async.config import RolloutConfig

    s = Sampling.from_rollout(RolloutConfig(temperature=0.7, top_p=0.9, top_k=5), seed=3)
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.7, 0.9, 5, 3)


async def test_busy_seconds_count_each_server_once_while_it_has_requests_and_every_request_is_reported(fakes):
    """The rollouter idle ratio's input: per server, the union of its requests' intervals (concurrent requests count
    once; time with none in flight does not count), and on_segment sees every request with its interval."""
    slow = await fakes(token_delay_s=0.02)
    client = make([slow.url])
    seen: list[tuple[int, float, float, int, str]] = []
    client.on_segment = lambda *a: seen.append(a)
    before = client.busy_seconds()
    await asyncio.gather(client.generate([1], 10), client.generate([2], 10), client.generate([3], 5))
    await asyncio.sleep(0.1)  # nothing in flight: not busy
    busy = client.busy_seconds()
    await client.close()
    assert before == [0.0]
    assert len(seen) == 3 and all(s[0] == 0 and s[3] in (5, 10) and s[4] == "length" for s in seen)
    union_s = max(s[2] for s in seen) - min(s[1] for s in seen)  # the three overlap: their union is one interval
    assert busy[0] == pytest.approx(union_s, abs=1e-3)
    assert busy[0] < sum(s[2] - s[1] for s in seen)  # overlapping requests were not added up
