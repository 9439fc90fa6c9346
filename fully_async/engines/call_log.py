"""CallLog: each engine server's last control calls, with their outcome and seconds, for the error of a weight sync
that passed advanced.sync_timeout_s (Rollouter.diagnose): which call a stuck sync waits for, on which server."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

KEPT = 8
"""How many of its last control calls are kept per server."""


@dataclass
class Call:
    what: str
    """`METHOD /path`."""
    started: float
    """Wall clock."""
    seconds: float | None = None
    """None while it runs."""
    outcome: str = "running"
    """ok | unanswered (its bound passed) | the exception's type | running."""


class CallLog:
    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._calls: dict[str, deque[Call]] = {}

    def started(self, url: str, what: str) -> Call:
        call = Call(what, time.time())
        self._calls.setdefault(url, deque(maxlen=self.kept)).append(call)
        return call

    @staticmethod
    def ended(call: Call, outcome: str) -> None:
        call.seconds, call.outcome = time.time() - call.started, outcome

    def text(self) -> str:
        """Per server, its last calls oldest first, one line each (`running (for N s)`: still unanswered)."""
        lines = []
        for url, calls in self._calls.items():
            lines.append(f"- {url}:")
            for c in calls:
                at = time.strftime("%H:%M:%S", time.localtime(c.started)) + f".{int(c.started % 1 * 1000):03d}"
                spent = f"{c.seconds:.3f} s" if c.seconds is not None else f"for {time.time() - c.started:.1f} s"
                lines.append(f"    {at} {c.what}: {c.outcome} ({spent})")
        return "\n".join(lines) if lines else "(no control calls yet)"
