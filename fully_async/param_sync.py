"""ParamSync: the weight-update protocol between the trainer and the engines.

    pause (admission off, engines abort in-flight requests) -> transfer the weights into every engine and set the
    new version (the transport's phases) -> resume (aborted requests continue under the new weights)

Each phase is timed (timing_s/param_sync/<phase>, and a span on the event trace's `sync` lane) and bounded by
async_training.sync_timeout_s; a phase that passes it fails the run with a ParamSyncError naming the phase, instead
of hanging. How the bytes move is the transport's business (fully_async/weights/): with the disk transport the
phases are export (work that needs no engine runs before the pause: the transport's `before_pause`), pause,
distribute, reload, verify, resume; the first sync starts with `connect` (the transport's prepare).

Two modes (async_training.sync_mode):
- blocking: `sync` runs every phase in the caller's (the trainer's) thread, as listed above.
- background: ParamSync's own thread runs the phases that read the trainer's weights (the transport's
  `background_phases`: disk: export into a new directory; collective: `stage`, a copy into a staging buffer that the
  next optimizer step does not touch), then pause, the rest of the transport's phases and resume; the trainer
  computes its next step meanwhile. The trainer calls `start` after its update and `weights_read` just before the
  next one (the only point where it must not go on: the next optimizer step would change the weights being read),
  so the export overlaps the rest of its step (stats, logging, waiting for its batch); `sync` is the two at once.
  At most one sync is in flight: the next `start` (and `wait`, which the trainer calls before a checkpoint) first
  waits for the last one, a phase of its own (`wait`). A background phase that fails or passes the timeout is
  raised, naming it, by the trainer's next call (`start`, `weights_read`, `wait` or `check`). The engines take a
  version only when its reload finished (the rollouter's ledger moves then), so admission never counts on weights
  that are not being served.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

from fully_async.config.sections.async_training import SYNC_MODES
from fully_async.handles import CallThread, resolve
from fully_async.trace import Tracer
from fully_async.weights import WeightTransport, build_transport
from fully_async.weights.base import ParamSyncError
from fully_async.weights.disk import default_weights_root
from fully_async.weights.verify import VERIFIED_METRIC

__all__ = ["SYNC_MODES", "ParamSync", "ParamSyncError", "default_weights_root"]

HOLD_ENV = "FULLY_ASYNC_TEST_HOLD_SYNC"
"""Tests only: "VERSION:PATH" makes the background sync of VERSION, once the engines are paused, create PATH and hold
still (a phase of its own, `test_hold`, under the sync timeout) until PATH is removed, so that a test can kill the
run exactly between pause and resume (tests/integration/test_background_sync.py)."""


class ParamSync:
    def __init__(
        self,
        rollouter: Any,
        backend: Any,
        weights_root: Path,
        dtype: str,
        timeout_s: float,
        tracer: Tracer | None = None,
        *,
        transport: str | WeightTransport = "disk",
        bucket_mb: float = 16,
        device: str = "cpu",
        mode: str = "blocking",
        verify: bool = True,
        staging: str = "device",
    ) -> None:
        """`rollouter`: the actor handle whose engines receive the weights; `backend`: the training backend that
        holds them; `weights_root` and `dtype` (the engines'): for transports that write files. `transport`: a
        built WeightTransport, or an async_training.weight_transport value (disk | collective | auto);
        `bucket_mb`, `device` (cpu | cuda) and `staging` (async_training.staging): for the collective transport.
        `mode`: an async_training.sync_mode value (blocking | background, see the module docstring). `verify`:
        async_training.verify_sync."""
        if mode not in SYNC_MODES:
            from fully_async.config import ConfigError

            raise ConfigError(f"async_training.sync_mode must be one of {list(SYNC_MODES)}, got {mode!r}")
        self.mode = mode
        self.rollouter, self.backend = rollouter, backend
        self.tracer = tracer
        self.timeout_s = timeout_s
        if isinstance(transport, str):
            transport = build_transport(transport, rollouter, backend, weights_root, dtype, verify, bucket_mb=bucket_mb,
                                        sync_timeout_s=timeout_s, device=device, staging=staging)  # fmt: skip
        self.transport = transport
        self._prepared = False
        self.syncs = 0
        self._phases = CallThread("param-sync-phase")
        """Runs each phase (`_phase`), so that the caller can stop waiting for one that hangs."""
        self._worker = CallThread("param-sync")
        """Runs the background syncs, one at a time."""
        self._inflight: concurrent.futures.Future | None = None
        """The background sync in flight (or finished and not yet collected by `wait`)."""
        self._done: dict[str, float] = {}
        """The background sync's phase timings, filled by its thread."""
        self._failed: ParamSyncError | None = None
        """Why a background sync failed; raised by every later sync / wait / check."""
        self._read: threading.Event | None = None
        """Set once the background sync in flight has read the backend's weights (None: nothing to wait for)."""
        self._read_timings: dict[str, float] = {}

    def _phase(self, name: str, timings: dict[str, float], fn) -> Any:
        """Run one phase in ParamSync's phase thread (named after the phase while it runs) and wait at most timeout_s
        for it. A phase that hangs (a peer that never answers) is left behind in that thread, and later phases get a
        new one: daemon threads, so one can never hold the interpreter's exit (a pool thread would: Python joins
        those at exit, and a CI run once waited out its time limit on one)."""
        start, wall = time.monotonic(), time.time()
        future = self._phases.submit(_named, f"param-sync-{name}", fn)
        try:
            done, _ = concurrent.futures.wait([future], self.timeout_s)
            if not done:
                self._phases = CallThread("param-sync-phase")
                waiting = self.transport.pending()
                raise ParamSyncError(
                    f"weight sync phase '{name}' did not finish within async_training.sync_timeout_s="
                    f"{self.timeout_s:g}s" + (f" ({waiting})" if waiting else "")
                )
            e = future.exception()
            if e is not None:
                raise ParamSyncError(f"weight sync phase '{name}' failed: {type(e).__name__}: {e}") from e
            return future.result()
        finally:
            self._timed(name, timings, start, wall)

    def _inline(self, name: str, timings: dict[str, float], fn) -> Any:
        """Run one phase that only hands work over (it cannot block: the transport says so with `quick_reads`) in the
        caller's thread, timed and named on failure like the others."""
        start, wall = time.monotonic(), time.time()
        try:
            return fn()
        except Exception as e:
            raise ParamSyncError(f"weight sync phase '{name}' failed: {type(e).__name__}: {e}") from e
        finally:
            self._timed(name, timings, start, wall)

    def _timed(self, name: str, timings: dict[str, float], start: float, wall: float) -> None:
        timings[f"timing_s/param_sync/{name}"] = time.monotonic() - start
        if self.tracer is not None:
            self.tracer.record("sync", name, wall, time.time())

    def sync(self, version: int) -> dict[str, float]:
        """Push the backend's current weights to every engine as `version`; returns per-phase timings and
        `timing_s/param_sync`, the seconds the caller was held. Background mode: returns once the weights are
        read (`start`, then `weights_read`); the engines' phases are reported by the `wait` that collects them."""
        t = self.start(version)
        add_timings(t, self.weights_read())
        return t

    def start(self, version: int) -> dict[str, float]:
        """Begin the sync of `version`; returns the timings of what held the caller (`timing_s/param_sync`).
        Blocking mode: the whole sync (as `sync`). Background mode: after waiting for the previous sync (`wait`),
        returns at once; ParamSync's thread reads the weights (the transport's first phases), then runs the engines'
        phases. The caller must not change the backend's weights before `weights_read` returned: the trainer
        calls it just before its next update, so the export overlaps the rest of its step."""
        t: dict[str, float] = {}
        start = time.monotonic()
        if self.mode == "background":
            t.update(self.wait())
        if not self._prepared:
            self._phase("connect", t, lambda: self.transport.prepare(self.rollouter))
            self._prepared = True
        if self.mode == "background":
            mine, engines = self.transport.background_phases(version)
            if self.transport.quick_reads:  # they only queue the reading ahead of the backend's next call: run here
                for name, fn in mine:
                    self._inline(name, t, fn)
                mine = []
            self._start_background(version, mine, hold_phase(version) + engines)
        else:
            self._run_engine_phases(t, self.transport.phases(version))
            self.syncs += 1
        t["timing_s/param_sync"] = time.monotonic() - start
        return t

    @property
    def reading(self) -> bool:
        """Whether a background sync started by `start` has phases reading the weights not collected by
        `weights_read` yet."""
        return self._read is not None

    def weights_read(self) -> dict[str, float]:
        """Wait until the sync in flight has read the backend's weights (background mode; at once otherwise, or
        when they were read already); returns the reading phases' timings (reported once) and
        `timing_s/param_sync`, the seconds waited. Raises ParamSyncError when a reading phase failed. Bounded:
        every phase is (by timeout_s)."""
        read = self._read
        if read is None:
            return {}
        start = time.monotonic()
        read.wait()
        self._read = None
        t = {**self._read_timings, "timing_s/param_sync": time.monotonic() - start}
        self.check()
        return t

    def _run_engine_phases(self, t: dict[str, float], phases: list) -> None:
        """pause, `phases`, resume; the leading phases the transport names in `before_pause` (work that touches no
        engine: the disk transport's export and write) run before the pause, so the engines are held only for what
        needs them."""
        pauses = self.transport.pauses_engines  # the adapter transport does not pause (weights/lora.py)
        ahead = list(itertools.takewhile(lambda p: p[0] in self.transport.before_pause, phases))
        for name, fn in ahead:
            self._phase(name, t, fn)
        phases = phases[len(ahead) :]
        if pauses:
            self._phase("pause", t, lambda: resolve(self.rollouter.pause.remote()))
        for name, fn in phases:
            out = self._phase(name, t, fn)
            if name == "verify":  # the transport's proof: {server: digest}, one per server that matched
                t[VERIFIED_METRIC] = float(len(out))
        if pauses:
            self._phase("resume", t, lambda: resolve(self.rollouter.resume.remote()))

    def _start_background(self, version: int, reading: list, phases: list) -> None:
        """ParamSync's thread for one sync: the `reading` phases (the backend's weights; `weights_read` returns
        when they are done), then pause, `phases`, resume."""
        timings: dict[str, float] = {}
        read_timings: dict[str, float] = {}
        read = threading.Event()

        def fail(e: BaseException) -> None:
            if isinstance(e, ParamSyncError):
                self._failed = ParamSyncError(f"background sync of version {version}: {e}")
                self._failed.__cause__ = e.__cause__
            else:
                self._failed = ParamSyncError(f"background sync of version {version} failed: {type(e).__name__}: {e}")

        def run() -> None:
            start = time.monotonic()
            try:
                try:
                    for name, fn in reading:
                        self._phase(name, read_timings, fn)
                finally:
                    read.set()
                self._run_engine_phases(timings, phases)
                self.syncs += 1
            except BaseException as e:  # noqa: BLE001 - any failure is the sync's, kept for the trainer
                fail(e)
            finally:
                timings["timing_s/param_sync/background"] = time.monotonic() - start
                self._done = timings

        self._done, self._read_timings, self._read = {}, read_timings, (read if reading else None)
        self._inflight = self._worker.submit(run)

    def wait(self) -> dict[str, float]:
        """Wait for the background sync in flight (nothing to do in blocking mode or with none in flight); returns
        its phase timings and `timing_s/param_sync/wait`, the seconds waited. Raises ParamSyncError naming the phase
        when it (or any earlier one) failed. The wait is bounded: every phase of the sync is (by timeout_s)."""
        start = time.monotonic()
        read = self.weights_read()  # its reading phases' timings, when not collected yet
        read.pop("timing_s/param_sync", None)  # the caller times its wait
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            self.check()
            return read
        inflight.result()  # run() keeps its failure for check()
        t = {**read, **self._done, "timing_s/param_sync/wait": time.monotonic() - start}
        self.check()
        return t

    def check(self) -> None:
        """Raise the failure of a background sync, if one failed (the trainer calls it while it waits for a
        batch: a sync that failed leaves the engines paused, and no batch may ever come)."""
        if self._failed is not None:
            raise self._failed

    def export(self, version: int) -> Path:
        """Write the current weights for `version` without touching the engines (resume: engines start on them)."""
        return self._phase("export", {}, lambda: self.transport.export(version))

    def close(self, remove: bool = True) -> None:
        inflight = self._inflight
        if inflight is not None:  # a background sync still reading the files: give it its phases' time, at most
            concurrent.futures.wait([inflight], min(self.timeout_s, 30.0))
        self.transport.close(remove)
        self._worker.close()
        self._phases.close()


def _named(name: str, fn) -> Any:
    """Run `fn` in the current thread renamed `name` (the phase's: a stack dump of a hung sync names its phase)."""
    threading.current_thread().name = name
    return fn()


def add_timings(m: dict[str, Any], timings: dict[str, float]) -> None:
    """Add a sync's timings into `m`, summing a key met twice (the seconds held, a phase of two syncs)."""
    for key, value in timings.items():
        m[key] = m.get(key, 0.0) + value


def hold_phase(version: int) -> list:
    """The `test_hold` phase HOLD_ENV asks for at `version` ([] when it names no hold, or another version)."""
    spec = os.environ.get(HOLD_ENV, "")
    held, _, path = spec.partition(":")
    if not spec or int(held) != version:
        return []
    marker = Path(path)

    def hold() -> None:
        marker.touch()
        while marker.exists():
            time.sleep(0.05)

    return [("test_hold", hold)]
