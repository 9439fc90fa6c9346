"""The limiter's arithmetic and leasing, in one process (the cluster-wide actor runs the same LimiterServer)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fully_async.config import RewardLimitsConfig
from fully_async.reward.limiter import Buckets, RateLimiter


def test_buckets_refill_at_rate_and_cap_at_burst():
    b = Buckets(0, rpm=600, tpm=0, burst_s=1.0, now=0.0)  # 10 requests/s, capacity 10
    assert b.try_take(0, 10, 0, now=0.0) == 0.0
    assert b.try_take(0, 1, 0, now=0.0) == pytest.approx(0.1)
    assert b.try_take(0, 1, 0, now=0.1) == 0.0
    b.give_back(0, 100, 0, now=100.0)
    assert b.level["requests"] == 10  # never above capacity


def test_a_grant_larger_than_the_bucket_waits_for_a_full_bucket_then_runs_negative():
    b = Buckets(0, rpm=0, tpm=600, burst_s=1.0, now=0.0)  # 10 tokens/s, capacity 10
    assert b.try_take(0, 0, 5, now=0.0) == 0.0
    assert b.try_take(0, 0, 50, now=0.0) == pytest.approx(0.5)  # needs a full bucket, not 50 tokens
    assert b.try_take(0, 0, 50, now=0.5) == 0.0
    assert b.level["tokens"] == pytest.approx(-40)
    assert b.try_take(0, 0, 1, now=0.5) == pytest.approx(4.1)  # the debt is paid back by waiting


def test_concurrency_slots_are_counted_and_released():
    b = Buckets(2, rpm=0, tpm=0, burst_s=1.0, now=0.0)
    assert b.try_take(2, 0, 0, now=0.0) == 0.0
    assert b.try_take(1, 0, 0, now=0.0) is None
    b.give_back(1, 0, 0, now=0.0)
    assert b.try_take(1, 0, 0, now=0.0) == 0.0


async def test_rpm_limit_holds_in_one_process_with_leases():
    lim = RateLimiter(RewardLimitsConfig(rpm=1200, burst_s=0.4, lease_s=0.2))  # 20/s, 8 in the bucket, leases of 4
    stamps: list[float] = []

    async def call():
        p = await lim.acquire()
        stamps.append(time.monotonic())
        lim.release(p)

    start = time.monotonic()
    await asyncio.gather(*(call() for _ in range(44)))
    # 8 at once from the full bucket, then 36 more at 20/s: about 1.8 s.
    assert 1.6 <= time.monotonic() - start <= 2.4
    assert lim.actor_calls <= 12  # permits come in leases of 4, not one call per request


@pytest.mark.parametrize("lease_s", [0.01, 1.0])  # slots going back to the buckets each call / handed over locally
async def test_max_concurrent_is_never_exceeded(lease_s):
    lim = RateLimiter(RewardLimitsConfig(max_concurrent=3, lease_s=lease_s, burst_s=2 * lease_s))
    running, peak = 0, 0

    async def call(i):
        nonlocal running, peak
        p = await lim.acquire()
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01 * (i % 3 + 1))
        running -= 1
        lim.release(p)

    await asyncio.gather(*(call(i) for i in range(30)))
    assert peak == 3
    assert lim.in_flight == 0
    await asyncio.sleep(lease_s + 0.05)
    assert lim._local.buckets.slots_out == 0  # every slot went back once its lease expired


async def test_tpm_is_settled_with_actual_usage_refunds_and_extra_charges():
    lim = RateLimiter(RewardLimitsConfig(tpm=6000, burst_s=1.0, lease_s=0.1))  # 100 tokens/s, capacity 100
    server = lim._local
    p = await lim.acquire(80)  # reserves 80 (plus a lease of 10)
    lim.release(p, used_tokens=20)  # a refund of 60
    await asyncio.sleep(0.15)  # idle for a lease period: what the process holds goes back
    assert server.granted["tokens"] == pytest.approx(20)  # only the actual usage stays spent
    p = await lim.acquire(50)
    lim.release(p, used_tokens=250)  # 200 more than reserved: charged, the bucket goes negative
    await asyncio.sleep(0.15)
    assert server.granted["tokens"] == pytest.approx(270)
    assert server.buckets.level["tokens"] < -100
    start = time.monotonic()
    p = await lim.acquire(10)  # waits until the debt is paid back by the refill
    assert time.monotonic() - start > 1.0
    lim.release(p, 10)


async def test_a_sequential_caller_reuses_its_lease_instead_of_asking_per_request():
    lim = RateLimiter(RewardLimitsConfig(rpm=60000, tpm=6e6, max_concurrent=4, lease_s=0.5, burst_s=1.0))
    for _ in range(50):
        p = await lim.acquire(100)
        lim.release(p, 90)
    assert lim.actor_calls <= 4
    lim.shutdown()
    assert lim._local.buckets.slots_out == 0 and lim._local.granted["tokens"] == pytest.approx(50 * 90)
