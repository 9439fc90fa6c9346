"""EngineError on its own: engines/process.py raises it and engines/base.py imports process.py, so it lives below
both (base.py re-exports it; `from fully_async.engines import EngineError` stays the public name)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """An engine server failed, or did not answer in time. The message names the server URL and its log file."""
