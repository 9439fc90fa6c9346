"""MessageQueue: the bounded, version-aware buffer of TrajectoryGroups between the rollouter and the trainer.

Runs as an async Ray actor (`create_message_queue`); the class itself is plain asyncio so its logic is tested
without Ray too. Contracts:

- Bounded with backpressure: `put` waits while the queue is full. Nothing is ever dropped silently.
- `get(k, trainer_version)` returns the k oldest groups that pass the staleness check at that version. Groups that
  fail it are removed, counted, and kept for re-issue; the rollouter collects their prompts with `take_reissue()`.
- `snapshot()` / `restore()` carry the queued groups and pending re-issues through a checkpoint (no pickle).
- `close(reason)` wakes every blocked caller with QueueClosed(reason).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from typing import Any

from fully_async.aio import bounded
from fully_async.gc_tuning import tune_for_throughput
from fully_async.protocol import PromptRef, TrajectoryGroup, decode_groups, encode_groups
from fully_async.staleness import is_fresh


class QueueClosed(RuntimeError):
    """The queue was closed (shutdown or a failure elsewhere); the message says why."""


class QueueTimeout(TimeoutError):
    """A put or get waited longer than its timeout; the message carries the queue's state."""


class MessageQueue:
    def __init__(self, capacity: int, max_staleness: int, tune_gc: bool = False) -> None:
        """`tune_gc`: set this process's garbage collector for throughput (fully_async/gc_tuning.py); the actor's
        process holds every queued trajectory. create_message_queue sets it, as the actor owns its process."""
        if capacity < 1 or max_staleness < 0:
            raise ValueError(f"capacity >= 1 and max_staleness >= 0 required, got {capacity}, {max_staleness}")
        if tune_gc:
            tune_for_throughput()
        self.capacity = capacity
        self.max_staleness = max_staleness
        # (min_version, group): the version is computed once at put, not at every staleness check.
        self._items: deque[tuple[int, TrajectoryGroup]] = deque()
        # A lower bound of the queued min_versions: while trainer_version - bound <= eta no scan is needed.
        self._oldest = None
        self._reissue: list[PromptRef] = []
        self._changed = asyncio.Condition()
        self._closed: str | None = None
        self._wanted = 0  # how many groups a waiting get needs (0: none waits)
        self._c = {
            "put": 0,
            "got": 0,
            "dropped_stale": 0,
            "reissue_taken": 0,
            "put_waits": 0,
            "get_waits": 0,
            "put_wait_s": 0.0,
            "get_wait_s": 0.0,
        }

    # -- producer ----------------------------------------------------------------------------------------------
    async def put(self, groups: list[TrajectoryGroup], timeout: float | None = None) -> int:
        """Append all `groups` at once, waiting for room; returns the queue size after. A batch larger than the
        room goes in when the queue is empty (so no batch can wait forever), and when a get waits for more groups
        than the queue holds: that consumer cannot free room, so waiting for it would hold both for ever (seen: 3
        queued of capacity 4, a get of 4 and a batch of 2 each waiting on the other)."""
        if not groups:
            return len(self._items)

        def fits() -> bool:
            held = len(self._items)
            return not held or held + len(groups) <= self.capacity or held < self._wanted

        async with self._changed:
            waited = await self._wait(fits, timeout, "put", len(groups))
            for g in groups:
                v = g.min_version
                self._items.append((v, g))
                self._oldest = v if self._oldest is None else min(self._oldest, v)
            self._c["put"] += len(groups)
            self._c["put_waits"] += waited > 0
            self._c["put_wait_s"] += waited
            self._changed.notify_all()
            return len(self._items)

    # -- consumer ----------------------------------------------------------------------------------------------
    async def get(self, k: int, trainer_version: int, timeout: float | None = None) -> list[TrajectoryGroup]:
        """The k oldest groups fresh enough to train at `trainer_version`, waiting until there are k.

        Stale groups met on the way are removed and their prompts kept for re-issue."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        async with self._changed:
            self._wanted = max(self._wanted, k)
            self._changed.notify_all()  # a put waiting for room may now go in (put's `fits`)
            try:
                waited = await self._wait(lambda: self._drop_stale(trainer_version) >= k, timeout, "get", k)
            finally:
                self._wanted = 0
            out = [self._items.popleft()[1] for _ in range(k)]
            self._c["got"] += k
            self._c["get_waits"] += waited > 0
            self._c["get_wait_s"] += waited
            self._changed.notify_all()
            return out

    def _drop_stale(self, trainer_version: int) -> int:
        """Remove groups too stale for `trainer_version`; return how many remain."""
        if self._oldest is not None and not is_fresh(self._oldest, trainer_version, self.max_staleness):
            keep: deque[tuple[int, TrajectoryGroup]] = deque()
            for v, g in self._items:
                if is_fresh(v, trainer_version, self.max_staleness):
                    keep.append((v, g))
                else:
                    self._reissue.append(g.prompt)
                    self._c["dropped_stale"] += 1
            self._items = keep
            self._oldest = min((v for v, _ in keep), default=None)
        return len(self._items)

    async def _wait(self, ready, timeout: float | None, what: str, n: int) -> float:
        """Wait on the condition until ready() or closed; raise QueueClosed / QueueTimeout.

        Returns the seconds spent blocked (0.0 when ready at once)."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        blocked = False
        while True:
            if self._closed is not None:
                raise QueueClosed(f"message queue closed: {self._closed}")
            if ready():
                return time.monotonic() - start if blocked else 0.0
            blocked = True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise QueueTimeout(f"{what}({n}) waited {timeout:.1f}s; queue state: {self.stats()}")
            try:
                await bounded(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                continue

    def take_reissue(self) -> list[PromptRef]:
        """Prompts of groups dropped as stale since the last call; the caller re-issues them."""
        out, self._reissue = self._reissue, []
        self._c["reissue_taken"] += len(out)
        return out

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def close(self, reason: str = "shutdown") -> None:
        async with self._changed:
            self._closed = reason
            self._changed.notify_all()

    def size(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, Any]:
        return {
            "size": len(self._items),
            "capacity": self.capacity,
            "pending_reissue": len(self._reissue),
            "closed": self._closed is not None,
            **self._c,
        }

    def snapshot(self) -> dict[str, Any]:
        """Queued groups (encoded bytes), prompts awaiting re-issue and counters, for a lossless checkpoint."""
        return {
            "groups": encode_groups(g for _, g in self._items),
            "meta": json.dumps({"reissue": [p.uid for p in self._reissue], "counters": self._c}),
        }

    async def restore(self, snap: dict[str, Any]) -> int:
        """Replace the contents with a snapshot's; returns the number of groups restored."""
        meta = json.loads(snap["meta"])
        async with self._changed:
            self._items = deque((g.min_version, g) for g in decode_groups(snap["groups"]))
            self._oldest = min((v for v, _ in self._items), default=None)
            self._reissue = [PromptRef.parse(u) for u in meta["reissue"]]
            self._c.update(meta["counters"])
            self._closed = None
            self._changed.notify_all()
            return len(self._items)


def create_message_queue(capacity: int, max_staleness: int, name: str | None = None, node_id: str | None = None):
    """Start the MessageQueue as an async Ray actor (one event loop; waits never block other calls), on node
    `node_id` when given (the job keeps it on the driver's node)."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000}
    if name:
        options["name"] = name
    if node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(MessageQueue).options(**options).remote(capacity, max_staleness, tune_gc=True)
