"""The infrastructure-failure rule: an environment's broken plumbing never becomes a reward.

An environment call fails for one of two reasons. A *task error* is the model's fault (an action the environment
rejects, a wrong answer): the environment is alive and says so, and the episode's reward stands, low as it may be.
An *infrastructure failure* is nobody's answer: the connection was refused or reset, the call timed out, the server
answered 5xx, the server died. Scoring such an episode 0 would train a fake reward (open-instruct measured 5-15 % of
episodes turned into zeros by preemptions, biasing every group's baseline).

So an episode hit by an infrastructure failure restarts from its prompt on a fresh environment (another server of
the pool, a new session), up to `rollout.multi_turn.env.infra_retries` times. Past the budget the episode raises
`InfraExhausted`; production drops the whole group and re-issues its prompt through admission, the same path as an
engine failure, so the staleness ledger stays exact (each prompt trained once) and no group is trained with a sample
missing from its baseline. `on_exhausted=zero_reward` keeps the naive rule (reward 0) for comparisons only.

Counted per sample in the reward info (`env_infra_failures`, `env_retries`, `env_infra/<kind>`), hence in
trajectories.jsonl and the batch metrics, and per run in the Rollouter's counters (`groups_env_infra`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

log = logging.getLogger(__name__)

T = TypeVar("T")

INFRA_KINDS = ("refused", "reset", "timeout", "http_5xx", "closed")
"""Kinds of infrastructure failure, as counted in reward info (`env_infra/<kind>`)."""


class InfraError(Exception):
    """An environment call failed for infrastructure reasons; `kind` is one of INFRA_KINDS."""

    def __init__(self, kind: str, message: str, url: str = "") -> None:
        super().__init__(f"{kind}: {message}" + (f" ({url})" if url else ""))
        self.kind, self.url = kind, url


class InfraExhausted(InfraError):
    """Every attempt of one episode failed for infrastructure reasons: the group is re-issued, never scored."""


def classify(exc: BaseException, url: str = "") -> InfraError | None:
    """The InfraError an exception from an environment call stands for, or None when it is no infrastructure
    failure (a bug or a task error, which the caller handles)."""
    if isinstance(exc, InfraError):
        return exc
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return InfraError("timeout", "the environment call timed out", url)
    if isinstance(exc, aiohttp.WSServerHandshakeError | aiohttp.ClientResponseError):
        if exc.status >= 500:
            return InfraError("http_5xx", f"HTTP {exc.status}", url)
        return None
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return InfraError("refused", str(exc), url)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | ConnectionError):
        return InfraError("reset", str(exc), url)
    if isinstance(exc, aiohttp.ClientError):
        return InfraError("reset", f"{type(exc).__name__}: {exc}", url)
    return None


async def with_retries(
    attempt: Callable[[int], Awaitable[T]],
    retries: int,
    counts: Counter[str],
    on_failure: Callable[[InfraError], Awaitable[None]] | None = None,
) -> T:
    """`await attempt(k)` for k = 0, 1, ... until one returns; an attempt that raises an infrastructure failure
    (see `classify`) is counted in `counts` (`env_infra_failures`, `env_infra/<kind>`, `env_retries`) and, after
    `on_failure(err)` (e.g. mark the server suspect), retried, at most `retries` times; then InfraExhausted. Any
    other exception propagates at once."""
    for k in range(retries + 1):
        try:
            return await attempt(k)
        except Exception as e:
            err = classify(e)
            if err is None:
                raise
            counts["env_infra_failures"] += 1
            counts[f"env_infra/{err.kind}"] += 1
            if on_failure is not None:
                await on_failure(err)
            if k == retries:
                raise InfraExhausted(err.kind, f"{retries + 1} attempts failed; last: {err}", err.url) from e
            counts["env_retries"] += 1
            log.info("environment attempt %d failed (%s); retrying on a fresh environment", k, err)
    raise AssertionError("unreachable")  # the loop returns or raises
