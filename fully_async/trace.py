"""Event trace: spans (lane, name, start, duration) that every actor records into the run dir.

Each process appends to its own file `RUN_DIR/trace/<name>.jsonl`, buffered and written in batches, so recording a span
costs a dict and a list append. Times are wall-clock seconds (`time.time()`): the only clock that lines up across the
rollouter, trainer and sync processes (on several nodes it is as good as their clock synchronisation).

Lanes: `engine/<i>` (one HTTP generate request on engine server i: a whole sample, or the segment of one between two
syncs), `reward` (scoring one sample), `tools` (one tool call of a multi-turn agent loop), `rollouter` (paused for a sync, validation runs), `trainer` (wait_for_batch,
update and its prepare / log_probs / train phases, param_sync, save_checkpoint, stats), `sync` (param-sync phases
connect (first sync), pause, the transport's (disk: export, reload), resume). A line `{"meta": {...}}` records facts
the report needs (the number of engine servers). docs/metrics.md describes the format.

`engine_idle_ratio` and `trainer_idle_ratio` are the definitions of the two idle ratios in metrics.jsonl
(docs/metrics.md); the report recomputes the logged ratios from the trace with them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLUSH_EVERY = 512
"""Spans buffered before a write."""
FLUSH_S = 2.0
"""Longest a recorded span waits in the buffer (checked when the next one is recorded)."""


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start: float
    """Wall-clock seconds (time.time())."""
    dur: float
    args: dict[str, Any]
    source: str = ""
    """Name of the trace file the span came from (the recording process)."""

    @property
    def end(self) -> float:
        return self.start + self.dur


class Tracer:
    """Buffered span recorder for one process. `enabled=False` makes every call a no-op."""

    def __init__(self, run_dir: str | Path, name: str, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "trace" / f"{name}.jsonl"
        self._buf: list[str] = []
        self._last_flush = time.monotonic()
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        """A span from wall-clock `start` to `end` (seconds)."""
        if not self.enabled:
            return
        rec = {"lane": lane, "name": name, "ts": round(start, 6), "dur": round(max(0.0, end - start), 6)}
        if args:
            rec["args"] = args
        self._buf.append(json.dumps(rec))
        if len(self._buf) >= FLUSH_EVERY or time.monotonic() - self._last_flush > FLUSH_S:
            self.flush()

    @contextlib.contextmanager
    def span(self, lane: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the enclosed block; the yielded dict takes extra args (e.g. sizes known only at the end)."""
        start = time.time()
        extra: dict[str, Any] = {}
        try:
            yield extra
        finally:
            self.record(lane, name, start, time.time(), **args, **extra)

    def meta(self, **facts: Any) -> None:
        if self.enabled:
            self._buf.append(json.dumps({"meta": facts}))
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        # Swapped out, not cleared after the write: ParamSync's background thread records into the same tracer, and
        # a span appended while the write runs lands in the next flush instead of being lost.
        buf, self._buf = self._buf, []
        if not buf:
            return
        with self.path.open("a") as f:
            f.write("\n".join(buf) + "\n")

    def close(self) -> None:
        if self.enabled:
            self.flush()


def load(run_dir: str | Path) -> tuple[list[Span], dict[str, Any]]:
    """Every span of a run (sorted by start) and the merged meta facts. Lines cut by a kill are skipped."""
    spans: list[Span] = []
    meta: dict[str, Any] = {}
    for path in sorted((Path(run_dir) / "trace").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "meta" in rec:
                meta.update(rec["meta"])
            else:
                spans.append(Span(rec["lane"], rec["name"], rec["ts"], rec["dur"], rec.get("args", {}), path.stem))
    spans.sort(key=lambda s: s.start)
    return spans, meta


# -- interval arithmetic shared by the metrics and the report -------------------------------------------------------
def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping [start, end) intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def busy_seconds(intervals: Iterable[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] covered by at least one interval."""
    return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in union(intervals))


def engine_idle_ratio(spans: Iterable[Span], num_engines: int, t0: float, t1: float) -> float:
    """fully_async/rollouter/idle_ratio over [t0, t1]: the share of engine-seconds with no request running, i.e.
    1 - sum over engines of (seconds engine i had >= 1 generate request in flight) / (num_engines * (t1 - t0))."""
    if t1 <= t0 or num_engines < 1:
        return 0.0
    per_engine: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        if s.lane.startswith("engine/"):
            per_engine.setdefault(s.lane, []).append((s.start, s.end))
    busy = sum(busy_seconds(iv, t0, t1) for iv in per_engine.values())
    return min(1.0, max(0.0, 1.0 - busy / (num_engines * (t1 - t0))))


def trainer_idle_ratio(spans: Iterable[Span], t0: float, t1: float) -> float:
    """fully_async/trainer/idle_ratio over [t0, t1]: seconds the trainer waited for a batch / (t1 - t0)."""
    if t1 <= t0:
        return 0.0
    waits = [(s.start, s.end) for s in spans if s.lane == "trainer" and s.name == "wait_for_batch"]
    return min(1.0, max(0.0, busy_seconds(waits, t0, t1) / (t1 - t0)))
