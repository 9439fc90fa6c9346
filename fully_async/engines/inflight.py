"""What a weight sync does to the requests in flight: async_training.on_sync, one choice per run.

- abort (the default): each request returns its tokens so far; after the resume the client sends prompt + tokens so
  far again with the remaining budget, and the engine prefills all of it again under the new weights
  (`client_reprefill_tokens`).
- recompute: the engines freeze the requests and drop their KV cache (vLLM `/pause?mode=keep&clear_cache=true`, which
  preempts every running request). After the resume each is prefilled again inside the engine, prompt + tokens so far,
  under the new weights, then goes on: the same tokens as abort gives, without the client's round trip
  (`engine_reprefill_tokens`, counted from the request's version spans).
- keep: the engines freeze the requests with their KV cache (`clear_cache=false`); after the resume they go on over a
  cache written by the old weights, with no prefill at all. Each token keeps its own version (the engine's label), and
  its cache version, the oldest weights in its context, is the version its request was sent at
  (`GenerationResult.cache_versions`; the trainer splits the mismatch by it: `offpolicy/cache_staleness_*`). The
  prefix cache cannot be reset while frozen requests hold blocks, so every request carries a cache salt of its
  version: a request never hits a prefix cached under other weights.

Contract: every mode keeps each request's budget (a request is never continued past its max_tokens: it is not
re-sent at all in recompute and keep), the per-token versions exact (the engine's spans), and the staleness bound
(a frozen request's tokens are labelled like a continued one's; cache versions are never older than the version the
request was admitted at). A server that leaves the pool mid-sync aborts its frozen requests: the client continues
them elsewhere (the abort path), nothing else is lost. An adapter sync (LoRA, model.lora.sync=adapter) does not pause
at all: requests finish under the adapter they named, in every mode.

Which engines: vLLM all three; SGLang abort and keep (`/pause_generation` mode `in_place`, the salt as `extra_key`);
its recompute is refused before the run (fully_async/config/sections/async_training.py `on_sync_problems`); the
emulated engines (engine=sim) freeze for both recompute and keep (they model no KV cache).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from fully_async.aio import bounded
from fully_async.engines.errors import EngineError
from fully_async.engines.types import GenerationResult, Segment

logger = logging.getLogger(__name__)

ON_SYNC = ("abort", "recompute", "keep")
"""The values of async_training.on_sync (= the engines' PauseMode)."""

COUNTERS = {
    "aborted_requests": "aborts",
    "frozen_requests": "frozen_requests",
    "client_reprefill_tokens": "client_reprefill_tokens",
    "engine_reprefill_tokens": "engine_reprefill_tokens",
}
"""Metric name -> the cumulative ClientStats field behind it; `metrics` turns two readings into one step's."""


def cache_salt(version: int) -> str:
    """The prefix-cache salt of a request sent at `version` under keep (the engine kind names the field)."""
    return f"fa-weights-v{version}"


def salt_fields(servers: Any, version: int) -> dict[str, Any]:
    """Request body fields that keep a keep-mode request off prefixes cached under other weights; none otherwise."""
    if servers.state.on_sync != "keep":
        return {}
    return servers.kind.cache_salt_fields(cache_salt(version))


def record_segment(
    stats: Any, on_sync: str, result: GenerationResult, seg: Segment, take: int, sent: int, prompt: int
) -> None:
    """Account one answered segment of `result`, already appended (its last `take` tokens, sent at version `sent`
    with a prompt of `prompt` tokens): its cache versions under keep, and, when it outlived a version change without
    being aborted (a frozen request), what the engine prefilled again under recompute: the prompt plus the tokens
    before each change."""
    if on_sync == "keep":
        if result.cache_versions is None:  # earlier segments: their own tokens' versions
            result.cache_versions = list(result.versions[: len(result.versions) - take])
        result.cache_versions.extend([sent] * take)
    if seg.finish_reason == "abort" or take == 0 or result.versions[-1] == sent:
        return  # versions only grow within a segment: the last one says there was no change (no per-token work)
    versions = np.asarray(result.versions[len(result.versions) - take :])
    changes = (np.flatnonzero(versions[1:] != versions[:-1]) + 1).tolist()
    if versions[0] != sent:  # frozen before its first token
        changes.insert(0, 0)
    stats.frozen_requests += 1
    if on_sync == "recompute":
        stats.engine_reprefill_tokens += sum(prompt + i for i in changes)


def record_continuation(stats: Any, prompt: int, kept: int) -> None:
    """A request aborted by a sync is sent again: prompt + its `kept` tokens are prefilled again by the engine."""
    stats.client_reprefill_tokens += prompt + kept


async def wait_resumed(servers: Any, idx: int | None, timeout_s: float) -> None:
    """Wait until the control plane has resumed (in-process event) and, for an aborted request, until its server
    says it is not paused (covers a control plane in another process)."""
    state = servers.state
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if state.paused:
            try:
                await bounded(state.resumed.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            continue
        if idx is None:
            return
        try:
            if not await servers.is_paused(servers.addresses[idx]):
                return
        except EngineError as e:  # the next send will meet the failure and retry elsewhere
            logger.warning("could not ask %s whether it is paused: %s", servers.addresses[idx], e)
            return
        await asyncio.sleep(0.05)
    raise EngineError(f"engines stayed paused longer than {timeout_s:g} s (engine.resume_timeout_s)")


def metrics(now: dict[str, Any], last: dict[str, Any]) -> dict[str, float]:
    """One step's in-flight metrics from two readings of the client's stats (the rollouter's `stats()["client"]`):
    requests a sync aborted, requests a sync froze (finished in this step), and the tokens prefilled again because of
    syncs, by the client (abort) and inside the engines (recompute). None of them under keep but frozen requests."""
    if not now:
        return {}
    return {f"fully_async/in_flight/{k}": float(now.get(f, 0) - last.get(f, 0)) for k, f in COUNTERS.items()}
