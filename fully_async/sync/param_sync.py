"""ParamSync: the weight-update protocol between the trainer and the engines.

    pause (admission off, engines abort in-flight requests) -> transfer the weights into every engine and set the
    new version (the transport's plan) -> resume (aborted requests continue under the new weights)

A transport (fully_async/weights/) says what one sync does as data, a SyncPlan: the phases that only queue the
reading of the trainer's weights (`queue`), those that read them (`reads`; the disk transport takes both from the
backend, `TrainingBackend.sync_export`), those that need no engine (`ahead`, run before the pause) and those on the engines (`engines`,
between pause and resume unless the plan needs no pause). ParamSync runs it: each phase timed
(timing_s/param_sync/<phase>, and a span on the event trace's `sync` lane) and bounded by
advanced.sync_timeout_s (fully_async/sync/phases.py); a phase that passes it fails the run with a
ParamSyncError naming the phase, instead of hanging. The first sync starts with `connect` (the transport's prepare).

Who runs what, and who waits for it: the one rule of both modes (async_training.sync_mode), stated in one test
(tests/unit/sync/test_rule.py). The mode picks only the runner that drives `reads` and the rest: BlockingSync
(sync/blocking.py: the caller's thread, which is held to the end) or BackgroundSync (sync/background.py: a kept
thread, `param-sync`). Every phase but `queue`'s runs in PhaseRunner's thread (`param-sync-<phase>`), bounded.

| a plan's phases | blocking | background (the default) |
|---|---|---|
| `queue` (they only queue the read ahead of the backend's next call) | the caller's thread, inside `start` | the caller's thread, inside `start` |
| `reads` (export, stage) | inside `start` | after `start` returned; the caller's `weights_read`, just before its next update (the only point where it must not go on: that optimizer step would change the weights being read), waits until they ended |
| `ahead`, pause, `engines`, resume | inside `start` | after the reads, while the caller computes; collected (timings, failure) by the next `start`, or by `wait` (before a checkpoint) |

`sync` is `start` and `weights_read` at once. In background mode at most one sync is in flight: `start` (and
`wait`) first collects the last one, a phase of its own (`wait`), so a version's directory or staging buffer is never
rewritten while engines read it. A failure in the background is raised, naming the phase, by the trainer's next call
(`start`, `weights_read`, `wait` or `check`). The engines take a version only when its reload finished (the
rollouter's ledger moves then), so admission never counts on weights that are not being served.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fully_async.config.sections.async_training import SYNC_MODES
from fully_async.handles import one_line, resolve
from fully_async.sync.background import BackgroundSync
from fully_async.sync.blocking import BlockingSync
from fully_async.sync.phases import PhaseRunner, add_timings
from fully_async.trace import Tracer
from fully_async.weights import WeightTransport, build_transport
from fully_async.weights.base import ParamSyncError, SyncPlan
from fully_async.weights.disk import default_weights_root
from fully_async.weights.verify import VERIFIED_METRIC

DIAGNOSE_S = 10.0
"""How long a sync that passed its timeout waits for the Rollouter's account of where it is stuck."""

__all__ = ["SYNC_MODES", "ParamSync", "ParamSyncError", "add_timings", "default_weights_root"]


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
        built WeightTransport, or a value weights/factory.py builds (disk | collective | auto | adapter |
        pkg.module:Class); `bucket_mb`, `device` (cpu | cuda) and `staging` (advanced.staging): for the
        collective transport. `mode`: an async_training.sync_mode value (see the module docstring). `verify`:
        async_training.verify_sync."""
        if mode not in SYNC_MODES:
            from fully_async.config import ConfigError

            raise ConfigError(f"async_training.sync_mode must be one of {list(SYNC_MODES)}, got {mode!r}")
        self.mode, self.rollouter, self.backend, self.timeout_s = mode, rollouter, backend, timeout_s
        if isinstance(transport, str):
            transport = build_transport(transport, rollouter, backend, weights_root, dtype, verify, bucket_mb=bucket_mb,
                                        sync_timeout_s=timeout_s, device=device, staging=staging)  # fmt: skip
        self.transport = transport
        self.phases = PhaseRunner(timeout_s, tracer, transport.pending, self._diagnose)
        self.runner: BlockingSync | BackgroundSync = BackgroundSync() if mode == "background" else BlockingSync()
        """Where `reads` and the rest of a plan run: the only thing the mode decides (the module docstring)."""
        self._prepared = False

    @property
    def syncs(self) -> int:
        """Syncs whose every phase finished."""
        return self.runner.completed

    @property
    def reading(self) -> bool:
        """Whether a background sync started by `start` may still read the weights (`weights_read` not called)."""
        return self.runner.reading

    def sync(self, version: int) -> dict[str, float]:
        """Push the backend's current weights to every engine as `version`; returns per-phase timings and
        `timing_s/param_sync`, the seconds the caller was held. Background mode: returns once the weights are
        read (`start`, then `weights_read`); the engines' phases are reported by the `wait` that collects them."""
        t = self.start(version)
        add_timings(t, self.weights_read())
        return t

    def start(self, version: int) -> dict[str, float]:
        """Begin the sync of `version`; returns the timings of what held the caller (`timing_s/param_sync`): the
        last sync's collection (`wait`), `connect` (the first sync), the `queue` phases, and in blocking mode every
        other phase. The caller must not change the backend's weights before `weights_read` returned."""
        t: dict[str, float] = {}
        start = time.monotonic()
        t.update(self.wait())  # the last sync, when one is in flight (background mode)
        if not self._prepared:
            self.phases.run("connect", t, lambda: self.transport.prepare(self.rollouter))
            self._prepared = True
        plan = self.transport.plan(version, self.mode == "background")
        for name, fn in plan.queue:  # they only queue the copy ahead of the backend's next call: nothing to wait for
            self.phases.inline(name, t, fn)
        reads = (lambda timings: self._run_phases(timings, plan.reads)) if plan.reads else None
        t.update(self.runner.submit(version, reads, lambda timings: self._run_held(timings, plan)))
        t["timing_s/param_sync"] = time.monotonic() - start
        return t

    def weights_read(self) -> dict[str, float]:
        """Wait until the sync in flight has read the backend's weights (at once in blocking mode, or when they
        were read already); returns the reading phases' timings (reported once) and `timing_s/param_sync`, the
        seconds waited. Raises ParamSyncError when a reading phase failed. Bounded: every phase is."""
        return self.runner.weights_read()

    def wait(self) -> dict[str, float]:
        """Wait for the background sync in flight (nothing to do in blocking mode or with none in flight); returns
        its phase timings and `timing_s/param_sync/wait`, the seconds waited. Raises ParamSyncError naming the phase
        when it (or any earlier one) failed."""
        return self.runner.collect()

    def check(self) -> None:
        """Raise the failure of a background sync, if one failed (the trainer calls it while it waits for a
        batch: a sync that failed leaves the engines paused, and no batch may ever come)."""
        self.runner.check()

    def export(self, version: int) -> Path:
        """Write the current weights for `version` without touching the engines (resume: engines start on them)."""
        return self.phases.run("export", {}, lambda: self.transport.export(version))

    def close(self, remove: bool = True) -> None:
        self.runner.close(min(self.timeout_s, 30.0))  # a sync still reading the files gets its phases' time
        self.transport.close(remove)
        self.phases.close()

    def _diagnose(self) -> str:
        """Where the Rollouter is stuck (its `diagnose`), asked within DIAGNOSE_S: for a phase's timeout message."""
        try:
            return resolve(self.rollouter.diagnose.remote(), DIAGNOSE_S)
        except Exception as e:  # a stand-in without it, or an actor whose event loop is blocked: say so, go on
            return f"the Rollouter gave no diagnosis within {DIAGNOSE_S:g} s: {one_line(e)}"

    def _run_phases(self, t: dict[str, float], phases: tuple) -> None:
        for name, fn in phases:
            out = self.phases.run(name, t, fn)
            if name == "verify":  # the transport's proof: {server: digest}, one per server that matched
                t[VERIFIED_METRIC] = float(len(out))

    def _run_held(self, t: dict[str, float], plan: SyncPlan) -> None:
        """`ahead` (no engine needed), then pause, `engines`, resume (no pause when the plan needs none)."""
        self._run_phases(t, plan.ahead)
        if plan.pause:
            self.phases.run("pause", t, lambda: resolve(self.rollouter.pause.remote()))
        self._run_phases(t, plan.engines)
        if plan.pause:
            self.phases.run("resume", t, lambda: resolve(self.rollouter.resume.remote()))
