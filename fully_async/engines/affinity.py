"""Sticky routing: every generate request of one episode goes to the engine server that holds its prefix.

A multi-turn episode sends its whole token history again at each call; the server that ran the previous call holds
that history in its prefix cache and prefills only the new tokens. A balancer that picks per request sends a later
call to a server that must prefill the whole history again (with 2 servers, about every other call).

The key. An episode names itself with the context variable `session` (any string; "" or unset: no episode).
production.py's `sample_id` IS this variable, so every agent loop's requests (ToolAgentLoop, rollout functions,
environments, validation) carry their sample's key without knowing about routing; asyncio tasks inherit it. A caller
whose requests run on tasks of their own (the gateway's HTTP handlers) sets it around each call with `keyed(key)`.

The rule (`Affinity.pick`):
- no key: the balancer's pick (the client's least-outstanding choice), as without affinity;
- a key's first request: the balancer's pick, which becomes the key's home;
- later requests: the home, while it is SERVING and is not the server this request just failed on; otherwise the
  balancer's pick becomes the new home. So a session moves only when its server left the pool (RETIRED), was set
  aside or died (DOWN), came back on old weights (STALE), or failed this very request; it does not move back.
- homes are kept for the `capacity` most recently used keys (LRU); a forgotten key's next request is a first one.

Load. The first request of a session goes where the fewest requests are in flight at that instant, so sessions
spread over the servers as requests would, and a server that is slow, or whose sessions are many or long, holds more
requests in flight and takes fewer new sessions: the balance is corrected at each session's start rather than at
each call. A session never moves for load alone (its prefix would be lost).

Behind a router (engine.router) the router chooses the server; the home then only decides the client's accounting.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from fully_async.engines.slots import SlotState

MAX_SESSIONS = 65536
"""Homes kept (least recently used forgotten first): far more than the episodes in flight at once, a few MB."""

session: contextvars.ContextVar[str] = contextvars.ContextVar("sample_id", default="")
"""The episode the current coroutine works for ("" : none); see the module docstring."""


@contextlib.contextmanager
def keyed(key: str) -> Iterator[None]:
    """Requests made inside belong to episode `key` (restored on exit)."""
    token = session.set(key)
    try:
        yield
    finally:
        session.reset(token)


class Affinity:
    """Session key -> home server index, bounded (module docstring). One per EngineClient; event-loop only."""

    def __init__(self, capacity: int = MAX_SESSIONS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._home: OrderedDict[str, int] = OrderedDict()
        self.homed = 0
        """First requests of a session (a forgotten session's next one included): a home chosen by the balancer."""
        self.stayed = 0
        """Requests that went to their session's home."""
        self.moved = 0
        """Sessions that moved because their home could not take the request."""

    def __len__(self) -> int:
        return len(self._home)

    def home(self, key: str) -> int | None:
        return self._home.get(key)

    def pick(self, client: Any, exclude: int | None = None) -> int:
        """The server for the current request of `session`'s episode. `client`: the EngineClient (its `pick(exclude)`
        balances, its `servers.slots` says who serves); `exclude`: the server this request just failed on."""
        key = session.get()
        if not key:
            return client.pick(exclude=exclude)
        home = self._home.get(key)
        slots = client.servers.slots
        if home is not None and home != exclude and home < len(slots) and slots[home] is SlotState.SERVING:
            self._home.move_to_end(key)
            self.stayed += 1
            return home
        idx = client.pick(exclude=exclude)
        if home is None:
            self.homed += 1
        elif idx != home:
            self.moved += 1
        self._home[key] = idx
        self._home.move_to_end(key)
        if len(self._home) > self.capacity:
            self._home.popitem(last=False)
        return idx

    def counts(self) -> dict[str, int]:
        return {"sessions": len(self._home), "homed": self.homed, "stayed": self.stayed, "moved": self.moved}


def metrics(now: dict[str, int], last: dict[str, int]) -> dict[str, float]:
    """One step's routing metrics from two readings of `Affinity.counts()` (the rollouter's `stats()["affinity"]`):
    the share of the step's keyed requests (those of an episode) that went to their session's home, and the sessions
    that moved during the step (their home left, was set aside, or failed the request). No entry in a step without a
    keyed request."""
    delta = {k: now.get(k, 0) - last.get(k, 0) for k in ("homed", "stayed", "moved")}
    keyed = sum(delta.values())
    if keyed <= 0:
        return {}
    return {
        "fully_async/routing/stayed_ratio": delta["stayed"] / keyed,
        "fully_async/routing/sessions_moved": float(delta["moved"]),
    }
