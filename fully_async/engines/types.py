"""The small types every room of the engine package shares: what one request asks (`Sampling`), what a generate call
and a whole sample return (`Segment`, `GenerationResult`), one control call (`HttpCall`) and the version and pause
state the control plane and the clients of one process share (`EngineState`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

PauseMode = Literal["abort", "recompute", "keep"]
"""What a pause does to the requests in flight (async_training.on_sync; fully_async/engines/inflight.py says each)."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request; the same values must be used by the trainer for its log-probs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_rollout(cls, rollout: Any, **overrides: Any) -> Sampling:
        """From a RolloutConfig (temperature, top_p, top_k)."""
        values = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)
        return cls(**{**values, **overrides})

    @classmethod
    def for_validation(cls, rollout: Any, **overrides: Any) -> Sampling:
        """From a RolloutConfig's `val` section: greedy (temperature 0) when do_sample is false, else its temperature,
        top_p and top_k, each null one the rollout's."""
        val = rollout.val
        if not val.do_sample:
            return cls(**{"temperature": 0.0, "top_p": 1.0, "top_k": -1, **overrides})
        values = {k: getattr(rollout, k) if getattr(val, k) is None else getattr(val, k)
                  for k in ("temperature", "top_p", "top_k")}  # fmt: skip
        return cls(**{**values, **overrides})


@dataclass
class GenerationResult:
    """One finished sample. token_ids, logprobs and versions have equal length (at most the requested budget); each
    is a list, or the engine's numpy array when the sample came from one segment whose tokens were all kept."""

    token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each chosen token under the distribution it was sampled from."""
    versions: list[int]
    """Weight version that produced each token."""
    finish_reason: str
    """'stop' (an end token or stop id, included in token_ids) or 'length' (budget spent)."""
    start_version: int = 0
    """Weight version when the request was first sent."""
    num_aborts: int = 0
    """Times a pause aborted the request and it was continued from its tokens so far."""
    num_retries: int = 0
    """Times the request was re-sent after a server failure."""
    servers: list[str] = field(default_factory=list)
    """URL of the server of each segment, in order."""
    cache_versions: list[int] | None = None
    """The oldest weight version in each token's context (its KV cache), where it can be older than the token's own:
    only under async_training.on_sync=keep (fully_async/engines/inflight.py); None = the same as `versions`."""


@dataclass
class Segment:
    """What one HTTP generate call returned (parsed by the adapter). The three sequences are lists, or numpy arrays
    (int32 ids and versions, float32 log-probs) from an engine that has them without parsing (engine=sim); the
    client passes a sample's only segment through as it is, so an array is never converted element by element."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int | None] | None = None
    """Per-token versions reported by the engine, None where it reported none (the client then uses its own)."""


@dataclass(frozen=True)
class HttpCall:
    """One control-plane HTTP call, built by the adapter and run by the generic machinery on every server."""

    method: str
    path: str
    params: dict[str, str] | None = None
    json: Any = None
    check: Any = None
    """Optional callable(response_json) -> error string or None, for endpoints that report failure in a 200."""


class EngineState:
    """Version and pause state shared by the control plane and the clients in this process."""

    def __init__(self) -> None:
        self.version = 0
        self.paused = False
        """Whether the clients in this process hold their requests (a weight sync is under way)."""
        self.on_sync: PauseMode = "abort"
        """What the run's syncs do to requests in flight (async_training.on_sync): the clients salt their prefix
        cache by version under keep, and label each token's cache version (fully_async/engines/inflight.py)."""
        self.cache_kept = False
        """Whether the pause in effect froze requests with their KV cache (keep, with a request in flight): the prefix
        cache cannot be reset until they finish."""
        self.clients_only = False
        """Whether the pause in effect holds only the clients, not the servers: it met no request in flight
        (control.py `pause`)."""
        self._resumed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def resumed(self) -> asyncio.Event:
        """Set while not paused. Re-created per event loop: an asyncio.Event is bound to the loop that first waits on
        it, and lifecycle code (or a test) may drive this state from a different loop later."""
        loop = asyncio.get_running_loop()
        if self._resumed is None or self._loop is not loop:
            self._resumed, self._loop = asyncio.Event(), loop
            if not self.paused:
                self._resumed.set()
        return self._resumed

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if paused:
            self.resumed.clear()
        else:
            self.resumed.set()
