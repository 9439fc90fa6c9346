"""ParamSync: the weight-update protocol between the trainer and the engines.

    pause (admission off, engines abort in-flight requests) -> transfer the weights into every engine and set the
    new version (the transport's phases) -> resume (aborted requests continue under the new weights)

Each phase is timed (timing_s/param_sync/<phase>, and a span on the event trace's `sync` lane) and bounded by
async_training.sync_timeout_s; a phase that passes it fails the run with a ParamSyncError naming the phase, instead
of hanging. How the bytes move is the transport's business (fully_async/weights/): with the disk transport the
phases are pause, export, distribute, reload, resume; the first sync starts with `connect` (the transport's prepare).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from fully_async.handles import resolve
from fully_async.trace import Tracer
from fully_async.weights import WeightTransport, build_transport
from fully_async.weights.disk import default_weights_root

__all__ = ["ParamSync", "ParamSyncError", "default_weights_root"]


class ParamSyncError(RuntimeError):
    """A sync phase failed or timed out; the message names the phase."""


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
    ) -> None:
        """`rollouter`: the actor handle whose engines receive the weights; `backend`: the training backend that
        holds them; `weights_root` and `dtype` (the engines'): for transports that write files. `transport`: a
        built WeightTransport, or an async_training.weight_transport value (disk | collective | auto);
        `bucket_mb` and `device` (cpu | cuda): for the collective transport."""
        self.rollouter, self.backend = rollouter, backend
        self.tracer = tracer
        self.timeout_s = timeout_s
        if isinstance(transport, str):
            transport = build_transport(transport, rollouter, backend, weights_root, dtype, bucket_mb=bucket_mb,
                                        sync_timeout_s=timeout_s, device=device)  # fmt: skip
        self.transport = transport
        self._prepared = False
        self.syncs = 0

    def _phase(self, name: str, timings: dict[str, float], fn) -> Any:
        """Run one phase in a daemon thread and wait at most timeout_s for it. A phase that hangs (a peer that never
        answers) is left behind in its thread: a daemon thread, so it can never hold the interpreter's exit (a pool
        thread would: Python joins those at exit, and a CI run once waited out its time limit on one)."""
        start, wall = time.monotonic(), time.time()
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as e:  # re-raised in the caller's thread below
                outcome["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name=f"param-sync-{name}", daemon=True).start()
        try:
            if not done.wait(self.timeout_s):
                waiting = self.transport.pending()
                raise ParamSyncError(
                    f"weight sync phase '{name}' did not finish within async_training.sync_timeout_s="
                    f"{self.timeout_s:g}s" + (f" ({waiting})" if waiting else "")
                )
            if "error" in outcome:
                e = outcome["error"]
                raise ParamSyncError(f"weight sync phase '{name}' failed: {type(e).__name__}: {e}") from e
            return outcome.get("value")
        finally:
            timings[f"timing_s/param_sync/{name}"] = time.monotonic() - start
            if self.tracer is not None:
                self.tracer.record("sync", name, wall, time.time())

    def sync(self, version: int) -> dict[str, float]:
        """Push the backend's current weights to every engine as `version`; returns per-phase timings."""
        t: dict[str, float] = {}
        start = time.monotonic()
        if not self._prepared:
            self._phase("connect", t, lambda: self.transport.prepare(self.rollouter))
            self._prepared = True
        self._phase("pause", t, lambda: resolve(self.rollouter.pause.remote()))
        for name, fn in self.transport.phases(version):
            self._phase(name, t, fn)
        self._phase("resume", t, lambda: resolve(self.rollouter.resume.remote()))
        self.syncs += 1
        t["timing_s/param_sync"] = time.monotonic() - start
        return t

    def export(self, version: int) -> Path:
        """Write the current weights for `version` without touching the engines (resume: engines start on them)."""
        return self._phase("export", {}, lambda: self.transport.export(version))

    def close(self, remove: bool = True) -> None:
        self.transport.close(remove)
