"""One state per server slot of an engine pool, and the moves between them.

A slot is an index into the pool's servers; it is never reused, so indices stay stable for the client's counters,
the trace and `fully_async.ctl`. Its state answers every question the pool, the control plane and the client ask:

    SERVING --died--> DOWN --restarted with the current weights--> SERVING
       |                 \\--restarted, the weights are in no directory (collective transport)--> STALE
       |--restarted or joined on old weights--> STALE --the next sync reached it--> SERVING
       \\--removed (any state)--> RETIRED (final)

Who may send what where: generate requests go to SERVING slots only (DOWN ones as a last resort, when every slot is
down: the send then fails and is retried); pool-wide control calls go to SERVING and STALE slots (a stale server
must get the next sync's weights); a router's worker list holds the SERVING ones.
"""

from __future__ import annotations

import enum
from collections import Counter


class SlotState(enum.Enum):
    SERVING = "serving"
    """In the pool, alive, holding the current weights and version."""
    DOWN = "down"
    """Its process (or engine host, or node) died: being restarted or replaced, out of rotation meanwhile."""
    STALE = "stale"
    """Alive on weights older than the current version (they exist in no directory): out of rotation until the next
    sync sends it the current weights."""
    RETIRED = "retired"
    """Removed from the pool (elastic engines). Final: a retired slot never serves again."""


class Slots:
    """The state of each slot, with O(1) counts (the client's balancer asks "is every slot serving?" per request)."""

    def __init__(self, count: int = 0) -> None:
        self._states = [SlotState.SERVING] * count
        self._counts: Counter[SlotState] = Counter({SlotState.SERVING: count})

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, index: int) -> SlotState:
        return self._states[index]

    def append(self, state: SlotState = SlotState.SERVING) -> int:
        """A new slot in `state`; its index."""
        self._states.append(state)
        self._counts[state] += 1
        return len(self._states) - 1

    def set(self, index: int, state: SlotState) -> None:
        """Move slot `index` to `state`. RETIRED is final: a retired slot stays retired (a late death report or
        restart of a server removed meanwhile changes nothing)."""
        old = self._states[index]
        if old is SlotState.RETIRED or old is state:
            return
        self._states[index] = state
        self._counts[old] -= 1
        self._counts[state] += 1

    def mark_down(self, index: int) -> None:
        self.set(index, SlotState.DOWN)

    def mark_stale(self, index: int) -> None:
        self.set(index, SlotState.STALE)

    def retire(self, index: int) -> None:
        self.set(index, SlotState.RETIRED)

    def back_up(self, index: int, stale: bool) -> None:
        """A DOWN slot's server is healthy again: SERVING, or STALE when it could not get the current weights. A slot
        in another state keeps it (a restart of a serving or stale server, or one removed meanwhile)."""
        if self._states[index] is SlotState.DOWN:
            self.set(index, SlotState.STALE if stale else SlotState.SERVING)

    def sync_reached(self) -> None:
        """A sync brought every server it reached (all SERVING and STALE slots) to the current version."""
        for i, state in enumerate(self._states):
            if state is SlotState.STALE:
                self.set(i, SlotState.SERVING)

    def count(self, state: SlotState) -> int:
        return self._counts[state]

    @property
    def all_serving(self) -> bool:
        return self._counts[SlotState.SERVING] == len(self._states)

    def indices(self, *states: SlotState) -> list[int]:
        """Indices of the slots in any of `states`, in order."""
        return [i for i, s in enumerate(self._states) if s in states]

    def of(self, state: SlotState) -> frozenset[int]:
        return frozenset(self.indices(state))
