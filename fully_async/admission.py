"""Admission: which prompt group starts generating next, and when. The rule the Rollouter follows, apart from how a
group is produced (fully_async/production.py).

A group of rollout.n samples starts only while all of these hold:
- the staleness ledger has room (`StalenessLedger.can_admit`, fully_async/staleness.py: the bound on off-policyness);
- the samples of admitted, unfinished groups stay within rollout.max_concurrent (a group's finished samples free
  their share at once);
- the start window is open (`start_window_open`);
- admission is not paused for a weight sync.

The prompt is the oldest one waiting to be generated again (failed, or dropped by the queue as stale) or else the
epoch cursor's next. Production reports how each group ended (`pushed`, `failed`, `filtered`), which settles it in the
ledger and wakes the loop. Everything runs on one event loop and needs no lock; pure apart from the queue call in
`take_stale_drops`, so it is unit-tested without Ray (tests/unit/test_admission.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from fully_async.aio import bounded
from fully_async.data import EpochCursor
from fully_async.handles import resolve_async
from fully_async.protocol import PromptRef
from fully_async.staleness import StalenessLedger

log = logging.getLogger(__name__)

ADMIT_CHUNK_GROUPS = 64
"""The admission loop yields to the event loop after this many groups. A sync opens a whole version at once (2,048
groups, 32,768 samples at 256 engines); started in one go, their tasks filled the loop for seconds of wall time and
the trainer's per-step stats() call, and so the trainer itself, waited behind them (1.8-4.6 s at each version's first
step, at time scale 2). In chunks, calls interleave."""

STALE_POLL_S = 0.1
"""The admission loop asks the queue for groups it dropped as stale at most this often."""

IDLE_POLL_S = 0.2
"""The admission loop looks again at least this often without a wake-up (stale drops are collected by polling)."""


class Producer(Protocol):
    """What admission needs of production (fully_async/production.py:Production)."""

    inflight_samples: int
    groups_pushed: int

    def start(self, prompt: PromptRef) -> Any: ...


class Admission:
    """The admission rule and loop over one ledger and cursor. `queue`: the MessageQueue handle (Ray actor or
    LocalActor) whose `take_reissue` gives the prompts it dropped as stale; `push_lock`: held while groups move from
    running to queued (production's push, the Rollouter's snapshot), so a stale drop is never taken in between."""

    def __init__(
        self,
        ledger: StalenessLedger,
        queue: Any,
        push_lock: asyncio.Lock,
        n: int,
        max_concurrent: int,
        start_concurrent: int,
        groups_per_step: int,
    ) -> None:
        self.ledger = ledger
        self.cursor: EpochCursor | None = None
        """Set once the dataset is loaded (Rollouter.prepare)."""
        self.queue, self.push_lock = queue, push_lock
        self.n, self.max_concurrent, self.start_concurrent = n, max_concurrent, start_concurrent
        self.groups_per_step = groups_per_step
        self.admitting = asyncio.Event()
        """Cleared while a weight sync pauses admission."""
        self.wake = asyncio.Event()
        """Set when something that may let a group in has changed (a group ended, a sync finished, shutdown)."""
        self.stopping = False
        self._stale_polled = float("-inf")

    # -- the rule ----------------------------------------------------------------------------------------------
    def may_admit(self, inflight_samples: int, groups_pushed: int) -> bool:
        """Whether one more group may start now, with `inflight_samples` samples of admitted groups unfinished and
        `groups_pushed` groups pushed to the queue since start."""
        n = self.n
        return (
            self.admitting.is_set()
            and self.ledger.can_admit()
            and inflight_samples + n <= max(self.max_concurrent, n)
            and self.start_window_open(groups_pushed)
        )

    def start_window_open(self, groups_pushed: int) -> bool:
        """Until the first trainer step's worth of groups has been pushed since start(), at most
        rollout.start_concurrent samples' worth of groups may be generating. The staleness bound admits (eta + 1)
        versions at once at start; spread over the engines they would all decode at a large batch, and the first
        groups to finish (the trainer's first batch) would wait behind them. Counted in whole groups, not samples:
        a group's finished samples must not let a new group in while its last sample (the one the batch waits for)
        is still decoding. Later versions open while the queue already holds the next batches, so only the start
        (and a resume, which calls start() again) needs this."""
        if groups_pushed >= self.groups_per_step:
            return True
        return (len(self.ledger.running) + 1) * self.n <= max(self.start_concurrent, self.n)

    def next_batch_ready(self) -> bool:
        """At a weight sync (before the ledger moves to the version being synced): whether the groups finished so far
        hold the trainer's next batch. The trainer has trained the groups of every version up to the one it syncs,
        (ledger version + 1) x groups per version, and takes groups_per_step more next. Groups dropped as stale and
        not collected yet still count, so it can say ready a little early: it only decides whether a sync lets
        requests finish before it pauses them (Rollouter.pause)."""
        ledger = self.ledger
        return ledger.accepted >= (ledger.version + 1) * ledger.groups_per_version + self.groups_per_step

    def admit_next(self) -> PromptRef:
        """Admit the next prompt (a re-issue first, else the cursor's next); the caller checked `may_admit`."""
        prompt = self.ledger.next_reissue() or self.cursor.next()
        if not self.ledger.admit(prompt):
            raise RuntimeError(f"admit_next() for {prompt.uid} without room under the staleness bound")
        return prompt

    # -- outcomes, reported by production ----------------------------------------------------------------------
    def pushed(self, prompts: Iterable[PromptRef]) -> None:
        """These groups were accepted by the queue."""
        for prompt in prompts:
            self.ledger.finish(prompt, ok=True)
        self.wake.set()

    def failed(self, prompt: PromptRef) -> None:
        """The group failed (engine error after retries, a reward source's drop, a put the queue refused): it is
        generated again."""
        self.ledger.finish(prompt, ok=False)
        self.wake.set()

    def filtered(self, prompt: PromptRef, reissue: bool) -> None:
        """Dynamic sampling left the group out: its slot is free; `reissue` generates the prompt again."""
        self.ledger.filter(prompt, reissue=reissue)
        self.wake.set()

    # -- stale drops -------------------------------------------------------------------------------------------
    async def take_stale_drops(self) -> None:
        """Move the prompts the queue dropped as stale into the ledger's re-issue list (caller holds push_lock)."""
        dropped = await resolve_async(self.queue.take_reissue.remote())
        if dropped:
            self.ledger.drop_stale(dropped)

    async def pull_stale_drops(self) -> None:
        """`take_stale_drops` at most every STALE_POLL_S: the loop wakes at every pushed batch, and a queue call per
        wake-up cost as much as the push itself; drops only happen when the trainer moves to a new version."""
        now = time.monotonic()
        if now - self._stale_polled < STALE_POLL_S:
            return
        self._stale_polled = now
        async with self.push_lock:
            await self.take_stale_drops()

    # -- the loop ----------------------------------------------------------------------------------------------
    async def run(self, producer: Producer, fail: Callable[[str], None]) -> None:
        """Admit groups into `producer` until `stop()`; a failure of the loop itself goes to `fail` (the trainer
        sees it through Rollouter.error() and fails the run with it)."""
        try:
            while not self.stopping:
                await self.admitting.wait()
                self.wake.clear()  # before the checks: a wake-up arriving during them is not lost
                await self.pull_stale_drops()
                admitted = 0
                while self.may_admit(producer.inflight_samples, producer.groups_pushed):
                    producer.start(self.admit_next())
                    admitted += 1
                    if admitted % ADMIT_CHUNK_GROUPS == 0:
                        await asyncio.sleep(0)  # let calls queued behind the burst (stats, pause) run
                with contextlib.suppress(asyncio.TimeoutError):
                    await bounded(self.wake.wait(), IDLE_POLL_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            fail(f"admission loop failed: {type(e).__name__}: {e}")
            log.exception("admission loop failed")

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
