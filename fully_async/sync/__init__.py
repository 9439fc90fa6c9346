"""The rooms ParamSync runs a sync plan with: `PhaseRunner` (one phase: timed, traced, bounded) and `BackgroundSync`
(one plan at a time in a kept thread, for async_training.sync_mode=background)."""

from fully_async.sync.background import BackgroundSync
from fully_async.sync.phases import PhaseRunner, add_timings

__all__ = ["BackgroundSync", "PhaseRunner", "add_timings"]
