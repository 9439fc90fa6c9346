"""BlockingSync: runs a sync whole in the caller's thread (async_training.sync_mode=blocking), with BackgroundSync's
interface (sync/background.py), so ParamSync runs both modes by one path.

Contract: `submit` returns once every phase ended (the caller held throughout), with their timings; a failure is
raised by `submit` itself and nothing is kept; nothing is ever in flight, so `reading` is False and `weights_read` and
`collect` return {}.
"""

from __future__ import annotations

from fully_async.sync.background import Timed


class BlockingSync:
    reading = False
    """Never: the weights were read before `submit` returned."""

    def __init__(self) -> None:
        self.completed = 0
        """Syncs whose every phase finished."""

    def submit(self, version: int, reads: Timed | None, rest: Timed) -> dict[str, float]:
        """Run `reads`, then `rest`, here; returns their timings."""
        timings: dict[str, float] = {}
        if reads is not None:
            reads(timings)
        rest(timings)
        self.completed += 1
        return timings

    def weights_read(self) -> dict[str, float]:
        return {}

    def collect(self) -> dict[str, float]:
        return {}

    def check(self) -> None:
        """Nothing kept: a blocking sync's failure was raised by its `submit`."""

    def close(self, wait_s: float) -> None:
        """Nothing to stop."""
