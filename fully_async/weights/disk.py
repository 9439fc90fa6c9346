"""The disk transport: the backend exports safetensors into `root/v<version>`, every engine server reloads that
directory (one control call per server, through the rollouter, which also labels the version).

The root is under /dev/shm when it exists (`default_weights_root`), so "disk" is memory bandwidth on one node; it
needs the trainer and the engines to see the same filesystem. The previous version's directory is kept until the
next sync, so a server restarted meanwhile still finds the weights it was told about; older ones are removed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from fully_async.handles import resolve
from fully_async.weights.base import Phase, WeightTransport

ROOT_PREFIX = "fully_async-weights-"
"""Name prefix of a root this transport created itself (and removes on close)."""


def default_weights_root(run_dir: str | Path) -> Path:
    """A fresh directory under /dev/shm when it exists (memory speed), else RUN_DIR/weights."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        return Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir=shm))
    return Path(run_dir) / "weights"


class DiskTransport(WeightTransport):
    name = "disk"

    def __init__(self, rollouter: Any, backend: Any, root: str | Path, dtype: str) -> None:
        self.rollouter, self.backend, self.dtype = rollouter, backend, dtype
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def prepare(self, rollouter: Any) -> None:
        """Nothing to set up: the engines read the root directly."""

    def phases(self, version: int) -> list[Phase]:
        out = self.root / f"v{version}"

        def reload() -> None:
            resolve(self.rollouter.load_weights.remote(str(out), version))
            self._prune(keep={out.name, f"v{version - 1}"})

        return [("export", lambda: self.export(version)), ("reload", reload)]

    def export(self, version: int) -> Path:
        out = self.root / f"v{version}"
        self.backend.export_weights(out, dtype=self.dtype)
        return out

    def _prune(self, keep: set[str]) -> None:
        for old in self.root.glob("v*"):
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def close(self, remove: bool = True) -> None:
        if remove and self.root.name.startswith(ROOT_PREFIX):
            shutil.rmtree(self.root, ignore_errors=True)
