"""Where a run's start-up goes: the wall-clock interval of each part from the command to the end of the first step,
and of each part of the shutdown after the last one.

Contract: `part(name)` (or `add(name, start, end)`) records a part; parts may overlap (the engines start while the
trainer ranks build), so the parts need not add up to the total. `finish(end)` closes the start-up at the first
step's end and returns its metrics (`timing_s/startup/<part>`, `timing_s/startup/total`: command to first step);
the same parts make one console line (`line()`, printed through `on_finish`) and spans on the trace's `startup`
lane (`trace`). The shutdown's parts go the same way under `shutdown` (`timing_s/shutdown/*`), into
RUN_DIR/startup.json (`write_record`), which holds both, since no step follows the shutdown.

The command's own start is the process's creation time (psutil, which Ray brings), so the interpreter's start and
the imports before the first line of ours count too; without psutil it is this module's import.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_IMPORTED_AT = time.time()


def process_start() -> float:
    """Wall-clock time this process was created (the command's start); this module's import time as a fallback."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except (ImportError, OSError):  # no psutil, or /proc unreadable: the import of this module is the next best mark
        return _IMPORTED_AT


class Timeline:
    """Named wall-clock intervals of one phase of a run (`startup` or `shutdown`), from `t0`."""

    def __init__(self, phase: str = "startup", t0: float | None = None) -> None:
        self.phase = phase
        self.t0 = process_start() if t0 is None else t0
        self.parts: dict[str, tuple[float, float]] = {}
        """name -> (start, end), wall-clock seconds, in the order recorded."""
        self.end: float | None = None
        self.on_finish: Callable[[Timeline], None] | None = None
        """Called once `finish` closed the phase (the job prints the line with it)."""

    def add(self, name: str, start: float, end: float) -> None:
        """Record part `name` from `start` to `end` (wall clock); a name recorded twice keeps the later interval."""
        self.parts.pop(name, None)
        self.parts[name] = (start, max(start, end))

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Record the enclosed block as part `name` (also when it raises: a failed start-up says what it spent)."""
        start = time.time()
        try:
            yield
        finally:
            self.add(name, start, time.time())

    def seconds(self, name: str) -> float:
        start, end = self.parts[name]
        return end - start

    def total(self) -> float:
        """From `t0` to the end (`finish`), or to the last part's end before it."""
        end = self.end if self.end is not None else max((e for _, e in self.parts.values()), default=self.t0)
        return max(0.0, end - self.t0)

    def finish(self, end: float | None = None) -> dict[str, float]:
        """Close the phase at `end` (now by default); its metrics."""
        self.end = time.time() if end is None else end
        if self.on_finish is not None:
            self.on_finish(self)
        return self.metrics()

    def metrics(self) -> dict[str, float]:
        """`timing_s/<phase>/<part>` for each part and `timing_s/<phase>/total`."""
        out = {f"timing_s/{self.phase}/{name}": self.seconds(name) for name in self.parts}
        out[f"timing_s/{self.phase}/total"] = self.total()
        return out

    def line(self) -> str:
        """One console line: the total, then each part with its seconds, in the order they started; a part that
        started before the previous one ended is marked `||` (it ran beside it)."""
        order = sorted(self.parts.items(), key=lambda kv: kv[1][0])
        words, last_end = [], None
        for name, (start, end) in order:
            sep = "" if last_end is None else (" || " if start < last_end - 0.05 else ", ")
            words.append(f"{sep}{name} {end - start:.1f}")
            last_end = end if last_end is None else max(last_end, end)
        what = "to the first step" if self.phase == "startup" else "after the last step"
        return f"{self.phase} {self.total():.1f} s {what}: " + "".join(words) + " (s)"

    def trace(self, tracer: Any) -> None:
        """One span per part on the trace's `<phase>` lane (fully_async/trace.py)."""
        for name, (start, end) in self.parts.items():
            tracer.record(self.phase, name, start, end)

    def to_json(self) -> dict[str, Any]:
        return {"t0": self.t0, "end": self.end, "parts": {k: list(v) for k, v in self.parts.items()}}


def write_record(run_dir: str | Path, *timelines: Timeline) -> Path:
    """RUN_DIR/startup.json: each timeline's parts and metrics (the shutdown's only record: no step follows it)."""
    path = Path(run_dir) / "startup.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    for t in timelines:
        record[t.phase] = t.to_json() | {"metrics": t.metrics()}
    path.write_text(json.dumps(record, indent=1))
    return path
