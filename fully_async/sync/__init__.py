"""The weight sync: `ParamSync` (param_sync.py), the protocol the trainer drives (pause, a transport's SyncPlan,
resume; blocking or in the background, by one path and one rule, stated in its docstring), and the rooms it runs a
plan with: `PhaseRunner` (phases.py: one phase timed, traced, bounded) and the two runners the mode chooses between,
`BlockingSync` (blocking.py: the caller's thread) and `BackgroundSync` (background.py: one plan at a time in a kept
thread). What moves the bytes is a weight transport (fully_async/weights/)."""

from fully_async.sync.background import BackgroundSync
from fully_async.sync.blocking import BlockingSync
from fully_async.sync.param_sync import ParamSync, ParamSyncError, default_weights_root
from fully_async.sync.phases import PhaseRunner, add_timings

__all__ = [
    "BackgroundSync",
    "BlockingSync",
    "ParamSync",
    "ParamSyncError",
    "PhaseRunner",
    "add_timings",
    "default_weights_root",
]
