"""The console of a run: every line the Ray workers print goes to the run's log file; the console shows each kind of
line once, then how many more times it came.

Without this, Ray forwards each worker's stdout/stderr to the driver's console line by line: every training rank
prints verl's import-time warnings (torchtitan / veomni / automodel / megatron engine "not available", NUMA), and a
dead engine makes the rollouter print "retrying a request" hundreds of times. `WorkerLog` replaces Ray's forwarding
handler in the driver:

- every line, with its source (actor and pid), goes to `RUN_DIR/logs/workers.log`;
- known start-up chatter of the libraries under us (`QUIET`: verl's "engine is not available" warnings and rank
  set-up lines, NUMA, the CPU platform notice, torch's is_fx_tracing warning, weight-loading bars) goes to that file
  only: a default run's console holds our own lines and the progress line;
- the console gets the first line of each other *kind* as Ray would print it; repeats are counted, and every
  `report_every_s` (and at `close()`) one line per kind that repeated says how many times it did.

The same chatter from the driver process itself (Ray's token-auth notice at `ray.init`, torch's is_fx_tracing
warning, matplotlib's font cache notice at a fresh machine's first plot) is held by `hold_driver_chatter()` (called
before `ray.init`) and written to the same file once it is open.

A line's kind is its source's actor (or task) name, not its pid, so all ranks of a role share kinds, plus its text with
digit runs replaced by `#` except inside addresses (`scheme://host:port`), so the same retry against two engines is two
kinds, while the same warning from two ranks, or with a different count in it, is one.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

_HANDLER = "ray_print_logs"  # the name under which ray.init registers its console forwarding
_OURS = "fully_async_worker_log"
_ADDRESS = re.compile(r"\w+://[^\s/]+")
_DIGITS = re.compile(r"\d+")
_AUTOSCALER_EVENT = ":event_summary:"  # what Ray's own forwarding keeps of the autoscaler's output

QUIET = re.compile(
    "|".join(
        (
            r"engine is not available",  # verl.workers.engine: one per optional engine (torchtitan, veomni, ...)
            r"^\s*warnings\.warn\(",  # the source line Python prints under each of those warnings
            r"NUMA affinity",  # verl's rank set-up without libnuma / pynvml
            r"is registered but not available",  # verl's platform registry on a CPU-only actor (our CPU platform)
            r"Platform override from VERL_PLATFORM",
            r"is_fx_tracing will return true",  # torch.fx, once per process
            r"Skipping monkey patch for",  # verl's model build: its per-rank set-up lines
            r"^Monkey patch \w+ model forward",  # the same for a vision-language model
            r"contains [\d.]+[KMGT]? parameters",
            r"memory allocated \(GB\)",
            r"^Total steps: \d+, num_warmup_steps",
            r"\[Rank \d+\] (Saved|Loaded) ",  # verl's checkpoint manager, every file of every checkpoint
            r"Loading weights:",  # transformers' progress bar
            r"^\s*$",
        )
    )
)
"""Lines that go to the log file only: third-party start-up chatter that says nothing about this run."""
DRIVER_CHATTER = (
    "ray._private.authentication.authentication_token_setup",
    "torch.fx._symbolic_trace",
    "matplotlib.font_manager",  # "generated new fontManager": the first plot on a machine without matplotlib's cache
)
"""Loggers in the driver process whose records go to the log file only (see hold_driver_chatter)."""


def line_kind(source: str, line: str) -> tuple[str, str]:
    """(source, the line with digit runs outside addresses replaced by '#'): what makes two lines the same event."""
    parts, last = [], 0
    for m in _ADDRESS.finditer(line):
        parts.append(_DIGITS.sub("#", line[last : m.start()]))
        parts.append(m.group(0))
        last = m.end()
    parts.append(_DIGITS.sub("#", line[last:]))
    return source, "".join(parts)


class WorkerLog:
    """Sink for Ray's worker log records (dicts with `lines`, `pid`, `actor_name` / `task_name`, `is_err`).

    Thread-safe: Ray calls `handle` from its log thread, `close` runs in the driver's."""

    def __init__(
        self,
        path: str | Path,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        report_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._out, self._err = out, err
        self.report_every_s = report_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], list] = {}  # kind -> [total, repeats not yet reported, last line, is_err]
        self._last_report = clock()

    def _sink(self, is_err: bool) -> TextIO:
        return (self._err or sys.stderr) if is_err else (self._out or sys.stdout)

    def handle(self, data: dict[str, Any]) -> None:
        pid = data.get("pid")
        lines = data.get("lines", [])
        if pid in ("autoscaler", "raylet"):
            source = str(pid)
            if pid == "autoscaler":  # its periodic status report is not for the console (nor for Ray's own handler)
                lines = [line for line in lines if _AUTOSCALER_EVENT in line]
        else:
            source = str(data.get("actor_name") or data.get("task_name") or "worker")
        is_err = bool(data.get("is_err"))
        with self._lock:
            for line in lines:
                self._file.write(f"({source} pid={pid}) {line}\n")
                if QUIET.search(line):
                    continue
                kind = line_kind(source, line)
                seen = self._seen.get(kind)
                if seen is None:
                    self._seen[kind] = [1, 0, line, is_err]
                    print(f"({source} pid={pid}) {line}", file=self._sink(is_err), flush=True)
                else:
                    seen[0] += 1
                    seen[1] += 1
                    seen[2] = line
            if self._clock() - self._last_report >= self.report_every_s:
                self._report()

    def _report(self) -> None:
        """One line per kind that repeated since the last report (caller holds the lock)."""
        self._last_report = self._clock()
        for (source, _), seen in self._seen.items():
            total, pending, line, is_err = seen
            if pending:
                print(
                    f"({source}) [{pending} more like this, {total} in all] {line}",
                    file=self._sink(is_err),
                    flush=True,
                )
                seen[1] = 0

    def write_line(self, source: str, pid: Any, line: str) -> None:
        """One line to the file only (the driver's own chatter)."""
        with self._lock:
            if not self._file.closed:
                self._file.write(f"({source} pid={pid}) {line}\n")

    def counts(self) -> dict[tuple[str, str], int]:
        """Lines seen per kind."""
        with self._lock:
            return {k: v[0] for k, v in self._seen.items()}

    def close(self) -> None:
        with self._lock:
            self._report()
            self._file.close()


class _DriverChatter(logging.Handler):
    """Holds the driver's DRIVER_CHATTER records (at most `keep`) until a WorkerLog is installed, then writes them, and
    later ones, to its file as the driver's lines."""

    def __init__(self, keep: int = 100) -> None:
        super().__init__(logging.INFO)
        self.keep = keep
        self.held: list[logging.LogRecord] = []
        self.sink: WorkerLog | None = None

    def emit(self, record: logging.LogRecord) -> None:
        sink = self.sink
        if sink is None:
            if len(self.held) < self.keep:
                self.held.append(record)
            return
        sink.write_line(f"driver:{record.name}", os.getpid(), self.format(record))

    def attach(self, sink: WorkerLog | None) -> None:
        self.sink = sink
        if sink is not None:
            held, self.held = self.held, []
            for record in held:
                self.emit(record)


_chatter = _DriverChatter()


def hold_driver_chatter() -> None:
    """Keep the driver's DRIVER_CHATTER loggers off the console (before `ray.init`, whose token-auth notice is one):
    their records wait for `install`'s log file. Idempotent."""
    for name in DRIVER_CHATTER:
        logger = logging.getLogger(name)
        logger.propagate = False
        if _chatter not in logger.handlers:
            logger.addHandler(_chatter)


_installed: WorkerLog | None = None
_ray_handler: Callable | None = None
"""Ray's own forwarding handler, taken out by install() and put back by uninstall()."""


def install(run_dir: str | Path, **kwargs: Any) -> WorkerLog | None:
    """Route the Ray workers' output of this driver through a `WorkerLog` writing `RUN_DIR/logs/workers.log`.
    Needs `ray.init` first (it registers the handler replaced here). Returns None, leaving Ray's own forwarding,
    when this Ray has no such handler (log_to_driver=False, or its internals changed)."""
    global _installed, _ray_handler
    from ray._private import worker as ray_worker

    dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
    names = {pair[0] for pair in getattr(dispatcher, "handlers", [])}
    if not names & {_HANDLER, _OURS}:
        # Deliberate fallback: a Ray whose log forwarding we do not recognise keeps printing every line itself.
        log.warning("Ray's worker log forwarding was not found; worker output is printed as Ray prints it")
        return None
    uninstall()
    sink = WorkerLog(Path(run_dir) / "logs" / "workers.log", **kwargs)
    _ray_handler = next((fn for name, fn in dispatcher.handlers if name == _HANDLER), None)
    dispatcher.remove_handler(_HANDLER)
    dispatcher.add_handler(_OURS, sink.handle)
    _installed = sink
    _chatter.attach(sink)
    print(
        f"fully_async: worker output in {sink.path}; the console shows each kind of line once, then counts "
        "(library start-up chatter: the file only)",
        flush=True,
    )
    return sink


def uninstall() -> None:
    """Flush the counts, close the log file and give the console back to Ray's own forwarding."""
    global _installed, _ray_handler
    if _installed is None:
        return
    from ray._private import worker as ray_worker

    dispatcher = ray_worker.global_worker_stdstream_dispatcher
    if _OURS in {pair[0] for pair in dispatcher.handlers}:
        dispatcher.remove_handler(_OURS)
        if _ray_handler is not None and ray_worker.global_worker.connected:
            dispatcher.add_handler(_HANDLER, _ray_handler)  # the very handler install() took out
    _chatter.attach(None)
    _installed.close()
    _installed, _ray_handler = None, None
