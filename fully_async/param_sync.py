"""ParamSync: the weight-update protocol between the trainer and the engines.

    pause (admission off, engines abort in-flight requests) -> export weights -> reload in every engine and set the
    new version -> resume (aborted requests continue under the new weights)

Each phase is timed (and recorded as a span on the event trace's `sync` lane) and bounded by
async_training.sync_timeout_s; a phase that passes it fails the run with a ParamSyncError naming the phase, instead
of hanging. Weights go through disk (safetensors the engines reload): under /dev/shm when it exists, else the run
dir. The previous version's files are kept until the next sync, so a server restarted meanwhile still finds the
weights it was told about.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from fully_async.handles import resolve
from fully_async.trace import Tracer


class ParamSyncError(RuntimeError):
    """A sync phase failed or timed out; the message names the phase."""


def default_weights_root(run_dir: str | Path) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir():
        return Path(tempfile.mkdtemp(prefix="fully_async-weights-", dir=shm))
    return Path(run_dir) / "weights"


class ParamSync:
    def __init__(
        self,
        rollouter: Any,
        backend: Any,
        weights_root: Path,
        dtype: str,
        timeout_s: float,
        tracer: Tracer | None = None,
    ) -> None:
        self.rollouter, self.backend = rollouter, backend
        self.tracer = tracer
        self.root, self.dtype, self.timeout_s = Path(weights_root), dtype, timeout_s
        self.root.mkdir(parents=True, exist_ok=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="param-sync")
        self.syncs = 0

    def _phase(self, name: str, timings: dict[str, float], fn) -> Any:
        start, wall = time.monotonic(), time.time()
        future = self._pool.submit(fn)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ParamSyncError(
                f"weight sync phase '{name}' did not finish within async_training.sync_timeout_s={self.timeout_s:g}s"
            ) from None
        except Exception as e:
            raise ParamSyncError(f"weight sync phase '{name}' failed: {type(e).__name__}: {e}") from e
        finally:
            timings[f"timing_s/param_sync/{name}"] = time.monotonic() - start
            if self.tracer is not None:
                self.tracer.record("sync", name, wall, time.time())

    def sync(self, version: int) -> dict[str, float]:
        """Push the backend's current weights to every engine as `version`; returns per-phase timings."""
        t: dict[str, float] = {}
        start = time.monotonic()
        out = self.root / f"v{version}"
        self._phase("pause", t, lambda: resolve(self.rollouter.pause.remote()))
        self._phase("export", t, lambda: self.backend.export_weights(out, dtype=self.dtype))
        self._phase("reload", t, lambda: resolve(self.rollouter.load_weights.remote(str(out), version)))
        self._phase("resume", t, lambda: resolve(self.rollouter.resume.remote()))
        for old in self.root.glob("v*"):
            if old.name not in (out.name, f"v{version - 1}"):
                shutil.rmtree(old, ignore_errors=True)
        self.syncs += 1
        t["timing_s/param_sync"] = time.monotonic() - start
        return t

    def export(self, version: int) -> Path:
        """Write the current weights for `version` without touching the engines (resume: engines start on them)."""
        out = self.root / f"v{version}"
        self._phase("export", {}, lambda: self.backend.export_weights(out, dtype=self.dtype))
        return out

    def close(self, remove: bool = True) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if remove and self.root.name.startswith("fully_async-weights-"):
            shutil.rmtree(self.root, ignore_errors=True)
