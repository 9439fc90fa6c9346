"""EngineError on its own, below every module of the engine package that raises it (process.py, host.py, router.py,
control.py, pool.py, ...), so none imports another for it; `from fully_async.engines import EngineError` stays the
public name."""

from __future__ import annotations


class EngineError(RuntimeError):
    """An engine server failed, or did not answer in time. The message names the server URL and its log file."""
