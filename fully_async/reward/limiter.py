"""Per-source limits on reward calls: concurrency, requests per minute, tokens per minute, held across the cluster.

Layers:
- `Buckets`: the arithmetic. Two token buckets (requests, tokens) refilled continuously at rpm/60 and tpm/60 per
  second up to `burst_s` seconds of rate, plus a count of concurrency slots. A grant of `n` needs the bucket to hold
  min(n, capacity): a request larger than the whole bucket waits for a full bucket and leaves it negative, so it
  passes once and the debt is paid back by waiting (no request is ever unservable).
- `LimiterServer`: grants on an event loop, first come first served (a large grant at the head is not starved by a
  stream of small ones). One lives in each source's named Ray actor (`LimiterActor`, scope=cluster) or in the
  process itself (scope=process, and unit tests without Ray).
- `RateLimiter`: what a scoring process uses. It leases permits in batches of about `lease_s` seconds of traffic, so
  the actor sees one call per batch rather than one per request; concurrency slots are leased for `lease_s` too and
  pass from a finished call to the process's next one until the lease expires, then go back so other processes get
  their turn (a slot is never held unused for longer than its lease). TPM is reserved from an estimate and settled with the usage the API reports: the
  difference is refunded or charged to the process's lease, and whatever a process holds when it has been idle
  for a lease period is returned to the bucket.

Why not aiolimiter or pyrate-limiter: both answer "may I take n now?" for one process and reject n larger than the
bucket; neither can refund, charge after the fact, run negative, or lease to other processes. What is left once
those are added is a dozen lines of refill arithmetic, which is all `Buckets` is.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from fully_async.aio import bounded
from fully_async.config import RewardLimitsConfig

log = logging.getLogger(__name__)

WINDOW_S = 60.0
"""Realized RPM / TPM are measured over this sliding window."""


class Buckets:
    """Request and token buckets plus concurrency slots. All amounts are floats; 0 rate/limit = unlimited."""

    def __init__(self, max_concurrent: int, rpm: float, tpm: float, burst_s: float, now: float) -> None:
        self.max_concurrent = max_concurrent
        self.rates = {"requests": rpm / 60.0, "tokens": tpm / 60.0}
        self.capacity = {k: r * burst_s for k, r in self.rates.items()}
        self.level = dict(self.capacity)
        self.slots_out = 0
        self._t = now

    def _refill(self, now: float) -> None:
        dt, self._t = max(0.0, now - self._t), max(now, self._t)
        for k, rate in self.rates.items():
            if rate:
                self.level[k] = min(self.capacity[k], self.level[k] + rate * dt)

    def try_take(self, slots: int, requests: float, tokens: float, now: float) -> float | None:
        """Take everything (returns 0.0), or nothing and return the seconds until the buckets could grant it
        (None: only a released slot can help)."""
        self._refill(now)
        if self.max_concurrent and self.slots_out + slots > self.max_concurrent:
            return None
        wait = 0.0
        for k, amount in (("requests", requests), ("tokens", tokens)):
            rate = self.rates[k]
            if rate and amount > 0:
                need = min(amount, self.capacity[k])
                if self.level[k] < need:
                    wait = max(wait, (need - self.level[k]) / rate)
        if wait > 0:
            return wait
        self.slots_out += slots
        for k, amount in (("requests", requests), ("tokens", tokens)):
            if self.rates[k]:
                self.level[k] -= amount
        return 0.0

    def give_back(self, slots: int, requests: float, tokens: float, now: float) -> None:
        """Return unused permits (positive) or charge extra usage (negative tokens)."""
        self._refill(now)
        self.slots_out = max(0, self.slots_out - slots)
        for k, amount in (("requests", requests), ("tokens", tokens)):
            if self.rates[k]:
                self.level[k] = min(self.capacity[k], self.level[k] + amount)


class LimiterServer:
    """Grants leases from one `Buckets`, first come first served, on the running event loop."""

    def __init__(self, limits: RewardLimitsConfig) -> None:
        self.limits = limits
        self.buckets = Buckets(limits.max_concurrent, limits.rpm, limits.tpm, limits.burst_s, time.monotonic())
        # Two queues, each first come first served: a wait for a slot never holds up a rate grant, or the reverse.
        self._heads = {True: asyncio.Lock(), False: asyncio.Lock()}
        self._released = asyncio.Event()
        self.granted = {"leases": 0, "requests": 0.0, "tokens": 0.0}

    async def acquire(self, slots: int, requests: float, tokens: float) -> None:
        async with self._heads[slots > 0]:
            while True:
                self._released.clear()
                wait = self.buckets.try_take(slots, requests, tokens, time.monotonic())
                if wait == 0.0:
                    break
                with contextlib.suppress(asyncio.TimeoutError):  # timed out = the buckets refilled: try again
                    await bounded(self._released.wait(), wait)
        self.granted["leases"] += 1
        self.granted["requests"] += requests
        self.granted["tokens"] += tokens

    def give_back(self, slots: int, requests: float, tokens: float) -> None:
        self.buckets.give_back(slots, requests, tokens, time.monotonic())
        self.granted["requests"] -= requests
        self.granted["tokens"] -= tokens
        self._released.set()

    def stats(self) -> dict[str, Any]:
        b = self.buckets
        return {**self.granted, "slots_out": b.slots_out, **{f"level/{k}": v for k, v in b.level.items()}}


class LimiterActor:
    """The cluster-wide buckets of one source (an async Ray actor named after the source)."""

    def __init__(self, limits: dict[str, Any]) -> None:
        self.limits = limits
        self.server = LimiterServer(RewardLimitsConfig(**limits))

    async def acquire(self, slots: int, requests: float, tokens: float) -> None:
        await self.server.acquire(slots, requests, tokens)

    def give_back(self, slots: int, requests: float, tokens: float) -> None:
        self.server.give_back(slots, requests, tokens)

    def config(self) -> dict[str, Any]:
        return self.limits

    def stats(self) -> dict[str, Any]:
        return self.server.stats()


def limiter_actor(source: str, limits: RewardLimitsConfig, namespace: str, kind: str = "reward"):
    """The named limiter actor `<kind>-limiter/<source>` in `namespace` (kind: reward sources, tools), created by
    whichever process asks first (`check` it)."""
    import dataclasses

    import ray

    return (
        ray.remote(LimiterActor)
        .options(name=f"{kind}-limiter/{source}", namespace=namespace, get_if_exists=True, num_cpus=0,
                 max_concurrency=10000)
        .remote(dataclasses.asdict(limits))
    )  # fmt: skip


def build_limiter(name: str, limits: RewardLimitsConfig, namespace: str, kind: str = "reward") -> RateLimiter | None:
    """The RateLimiter of one limited thing (a reward source, a tool): None when `limits` limit nothing; with
    scope=cluster, backed by its named actor when Ray is running (else, logged, this process's own buckets)."""
    if not limits.active():
        return None
    if limits.scope == "cluster":
        import ray

        if ray.is_initialized():
            return RateLimiter(limits, limiter_actor(name, limits, namespace, kind))
        log.info("%s %s: Ray is not running; its limits hold for this process only", kind, name)
    return RateLimiter(limits)


@dataclass
class Permit:
    """One admitted call: its reserved tokens, the expiry of the slot lease it holds, and how long it waited."""

    tokens: float
    slot_expiry: float | None
    wait_s: float


class RateLimiter:
    """A process's view of one source's limits: `permit = await acquire(estimate)`, then `release(permit, used)`.

    `actor` is the source's LimiterActor handle (scope=cluster) or None for a limiter inside this process."""

    def __init__(self, limits: RewardLimitsConfig, actor: Any = None) -> None:
        self.limits = limits
        self.actor = actor
        self._local = LimiterServer(limits) if actor is None else None
        self.batch_requests = max(1, math.ceil(limits.rpm / 60.0 * limits.lease_s)) if limits.rpm else 0
        self.batch_tokens = limits.tpm / 60.0 * limits.lease_s if limits.tpm else 0.0
        self._requests = 0.0
        self._tokens = 0.0  # may go negative: usage above the estimates, owed to the bucket
        self._negotiate = asyncio.Lock()
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._idle_slots: list[float] = []  # lease expiries of slots held and not in use
        self._idle_since: float | None = None
        self._closed = False
        self._slot_task: asyncio.Task | None = None
        self.waiting = 0
        self.in_flight = 0
        self.wait_s = 0.0
        self.acquired = 0
        self.actor_calls = 0  # awaited calls to the buckets (gives back are sent without waiting)
        self.rate_calls = 0  # of which for RPM / TPM permits; the rest lease concurrency slots
        self._window: collections.deque[tuple[float, float]] = collections.deque()  # (time, tokens) per call

    async def check(self, source: str) -> None:
        """Every process must configure the same limits for one source: a mismatch is an error, not a silent choice
        of whichever process created the actor first."""
        import dataclasses

        from fully_async.config import ConfigError

        if self.actor is None:
            return
        wanted, have = dataclasses.asdict(self.limits), await self.actor.config.remote()
        if have != wanted:
            raise ConfigError(
                f"reward source {source!r}: this process has limits {wanted} but the cluster's limiter was created "
                f"with {have}; every process must configure the same limits"
            )

    async def _ask(self, slots: int, requests: float, tokens: float) -> None:
        self.actor_calls += 1
        if self.actor is None:
            grant = asyncio.ensure_future(self._local.acquire(slots, requests, tokens))
        else:
            grant = asyncio.ensure_future(self._remote_acquire(slots, requests, tokens))
        try:
            await asyncio.shield(grant)
        except asyncio.CancelledError:
            # The caller gave up (shutdown, an outer timeout) but the grant may still land: return it when it does.
            grant.add_done_callback(
                lambda f: f.cancelled() or f.exception() is not None or self._give(slots, requests, tokens)
            )
            raise

    async def _remote_acquire(self, slots: int, requests: float, tokens: float) -> None:
        await self.actor.acquire.remote(slots, requests, tokens)

    def _give(self, slots: int, requests: float, tokens: float) -> None:
        if not (slots or requests or tokens):
            return
        if self.actor is None:
            self._local.give_back(slots, requests, tokens)
        else:  # fire and forget: the actor applies it in order with this process's other calls
            self.actor.give_back.remote(slots, requests, tokens)

    # -- concurrency slots: leased one at a time, handed between this process's calls until the lease expires --
    async def _take_slot(self) -> float:
        now = time.monotonic()
        while self._idle_slots:
            expiry = self._idle_slots.pop()
            if expiry > now:
                return expiry
            self._give(1, 0, 0)
        fut = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(fut)
        if self._slot_task is None or self._slot_task.done():
            self._slot_task = asyncio.get_running_loop().create_task(self._lease_slots())
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._hand_slot(fut.result())
            raise

    async def _lease_slots(self) -> None:
        """Ask the buckets for one slot at a time while calls wait (a finished call may serve one first)."""
        while any(not f.done() for f in self._slot_waiters):
            await self._ask(1, 0, 0)
            self._hand_slot(time.monotonic() + self.limits.lease_s, keep_idle=False)

    def _hand_slot(self, expiry: float, keep_idle: bool = True) -> None:
        """Give a slot to the first waiting call, else keep it idle until its lease expires (the next call of this
        process takes it without asking the actor), then give it back: no process holds an unused slot longer."""
        now = time.monotonic()
        while expiry > now and self._slot_waiters:
            fut = self._slot_waiters.popleft()
            if not fut.done():
                fut.set_result(expiry)
                return
        if expiry <= now or not keep_idle:  # a grant that landed after its waiters were served goes straight back
            self._give(1, 0, 0)
            return
        self._idle_slots.append(expiry)
        asyncio.get_running_loop().call_later(expiry - now, self._expire_idle_slots)

    def _expire_idle_slots(self) -> None:
        if self._closed:
            return
        now = time.monotonic()
        expired = [e for e in self._idle_slots if e <= now]
        if expired:
            self._idle_slots = [e for e in self._idle_slots if e > now]
            self._give(len(expired), 0, 0)

    # -- the public API --------------------------------------------------------------------------------------
    async def acquire(self, tokens: float = 0.0) -> Permit:
        """Wait until this call may start under every limit; `tokens` is its estimated total (prompt + max output)."""
        start = time.monotonic()
        lim = self.limits
        tokens = float(tokens) if lim.tpm else 0.0
        self.waiting += 1
        self._idle_since = None
        try:
            if lim.rpm or lim.tpm:
                async with self._negotiate:
                    ask_requests = self.batch_requests if lim.rpm and self._requests < 1 else 0
                    ask_tokens = tokens - self._tokens + self.batch_tokens if lim.tpm and self._tokens < tokens else 0.0
                    if ask_requests or ask_tokens:
                        self.rate_calls += 1
                        await self._ask(0, ask_requests, ask_tokens)
                        self._requests += ask_requests
                        self._tokens += ask_tokens
                    if lim.rpm:
                        self._requests -= 1
                    self._tokens -= tokens
            expiry = await self._take_slot() if lim.max_concurrent else None
        finally:
            self.waiting -= 1
        wait = time.monotonic() - start
        self.in_flight += 1
        self.acquired += 1
        self.wait_s += wait
        return Permit(tokens, expiry, wait)

    def release(self, permit: Permit, used_tokens: float | None = None) -> None:
        """The call ended; `used_tokens` is the usage it reported (None: keep the estimate)."""
        now = time.monotonic()
        self.in_flight -= 1
        used = permit.tokens if used_tokens is None else float(used_tokens)
        self._window.append((now, used))
        if self.limits.tpm:
            self._tokens += permit.tokens - used  # refund (>0) or extra charge (<0)
        if permit.slot_expiry is not None:
            self._hand_slot(permit.slot_expiry)
        if not self.waiting and not self.in_flight and not self._closed:
            # Idle: what this process holds goes back to the bucket unless a call comes within a lease period.
            self._idle_since = now
            asyncio.get_running_loop().call_later(self.limits.lease_s, self._return_if_idle, now)

    def _return_if_idle(self, since: float) -> None:
        if not self.waiting and not self.in_flight and self._idle_since == since:
            self.close()

    def close(self) -> None:
        """Give back the rate permits held (idle slots go back as their leases expire, or here at shutdown)."""
        self._give(0, self._requests, self._tokens)
        self._requests, self._tokens = 0.0, 0.0

    def shutdown(self) -> None:
        """Give back everything this process holds; later timers find nothing to return."""
        self.close()
        self._give(len(self._idle_slots), 0, 0)
        self._idle_slots = []
        self._closed = True

    def realized(self) -> tuple[float, float]:
        """(requests, tokens) per minute that this process completed over the last WINDOW_S seconds."""
        now = time.monotonic()
        while self._window and self._window[0][0] < now - WINDOW_S:
            self._window.popleft()
        if not self._window:
            return 0.0, 0.0
        per_min = 60.0 / max(1.0, min(WINDOW_S, now - self._window[0][0]))
        return len(self._window) * per_min, sum(t for _, t in self._window) * per_min
