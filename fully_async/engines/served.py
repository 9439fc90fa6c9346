"""The weights an engine pool serves now, as what a server that joins or comes back must load before it serves
(`ServedWeights`, held by the pool as `EngineServers.weights`).

A weight sync writes it: a reload records its directory and the per-node copies it read (control.py
`load_weights`), a collective sync records that the latest weights are in no directory (control.py
`weights_received`), an adapter sync its current adapter (adapters.py). A server that starts, restarts or joins
reads it (elastic.py `join`, `bring_current`): it reloads the directory (or its node's copy), loads the current
adapter, and is labelled with the version; where the latest weights exist in no directory it waits out of rotation as
STALE (`stale_on_return`) until the next sync reaches it: a reload, or a weight group formed at the current `epoch`.

The version is not held here: it stays in the pool's `EngineState` (types.py) beside the pause state, because the
clients read it on every request and the control plane sets it with the pause under the pool's membership lock. This
object reads it there, from the same state.

The pool's membership (its processes, slots, hosts, router, events) is the pool's own (pool.py); this object holds no
server and calls none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fully_async.engines.types import EngineState


class ServedWeights:
    """What a server of one pool must load before it serves (see the module docstring). Written by a sync under the
    pool's membership lock, read by joins and comebacks under it."""

    def __init__(self, state: EngineState, adapters: Any = None) -> None:
        self._state = state
        self.directory: Path | None = None
        """Directory of the weights loaded last; a restarted or joining server reloads it (or its node's copy, below).
        None: no reload so far (the servers' start-up weights), or the latest weights came by collective."""
        self.node_dirs: dict[str, Path] = {}
        """Ray node id -> that node's copy of `directory`, for servers on nodes that cannot read it (disk transport,
        fully_async/weights/disk.py)."""
        self.adapters = adapters
        """The versioned LoRA adapters the servers hold (adapters.py `Adapters`; typed Any: importing it here would
        close an import circle through control.py, which reads this object); None: full-weight syncs only."""
        self.epoch = 0
        """Bumped whenever the servers' workers change (a restart, a join, a leave, a node without a weights copy;
        elastic.py): a weight group formed at an older epoch must be re-formed."""

    @property
    def stale_on_return(self) -> bool:
        """Whether a server that (re)starts now cannot get the current weights: they are in no directory (collective
        transport) and differ from the start-up ones. With adapters it can: the base model it starts on and the
        current adapter it loads (`elastic.bring_current`)."""
        return self.directory is None and self._state.version > 0 and self.adapters is None
