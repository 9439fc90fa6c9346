"""Engine warm-up: throw-away requests of the run's own shapes, sent to a server after it starts and before it takes
traffic, so that the first batch costs what a steady one does.

A fresh engine server pays once for what its first requests touch: on vLLM-CPU the first request of a run took
17.5 s (the first batch's median generate time was 6.7x a steady batch's with every cache warm), the kernels and
buffers of each new batch size being set up as it first meets them. The warm-up spends that while nothing waits for
the server: at the pool's start it runs while the trainer ranks build (fully_async/job.py), after a restart or a join
before the server is back in rotation.

Contract (`warm`): for every server named, first one request alone, then `WarmupPlan.requests` at once (the batch
shape the run's admission sends it), each the plan's prompt to `max_tokens` tokens (the run's response length, at
most MAX_TOKENS) with the run's sampling; servers
are warmed at once. The answers are thrown away (their tokens are in no trajectory, no version or staleness is
touched). A warm-up that fails or passes its bound is logged and given up: the server is healthy, and serves cold
(a dead server is the client's to find, as any other time). Returns each server's seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fully_async.aio import bounded
from fully_async.engines.base import EngineKind
from fully_async.engines.errors import EngineError
from fully_async.engines.types import HttpCall, Sampling

if TYPE_CHECKING:
    from fully_async.engines.control import ControlPlane

logger = logging.getLogger(__name__)


@runtime_checkable
class WarmedPool(Protocol):
    """What a warm-up reads of the pool: its kind (the generate shapes) and the control plane that sends the calls."""

    kind: EngineKind
    control: ControlPlane


MAX_TOKENS = 64
"""Most tokens a warm-up request asks for: decode steps after the first few meet no new shape, while a long-response
run's full length (thousands of tokens) would cost each warm-up minutes."""


@dataclass(frozen=True)
class WarmupPlan:
    """What warms one server: `requests` at once (after one alone) of `prompt_ids` to `max_tokens` tokens."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    requests: int
    timeout_s: float
    """Bound of one server's whole warm-up; past it the server serves cold."""

    @classmethod
    def of_run(cls, prompts: list[list[int]], max_tokens: int, sampling: Sampling, requests: int, timeout_s: float):
        """The plan for a run whose prompts (token ids, some of the dataset's) are `prompts`: the longest of them
        (the widest shapes the first batch meets) to `max_tokens` (at most MAX_TOKENS), or None when there is nothing
        to send."""
        if requests < 1 or not prompts:
            return None
        return cls(tuple(max(prompts, key=len)), min(max_tokens, MAX_TOKENS), sampling, requests, timeout_s)


async def warm(pool: WarmedPool, procs: list[Any], plan: WarmupPlan | None) -> dict[str, float]:
    """Warm the servers `procs` of `pool` (processes with a `url`, in the pool or about to join it) by `plan`
    (None: nothing to do), all at once. {url: seconds} of each server's warm-up, failed ones included."""
    if plan is None or not procs or pool.kind.in_process:  # emulated engines (engine=sim) have no cold start
        return {}
    async with pool.control.session() as session:
        spent = await asyncio.gather(*(_warm_one(pool, session, p, plan) for p in procs))
    return dict(zip([p.url for p in procs], spent))


async def _warm_one(pool: WarmedPool, session: Any, proc: Any, plan: WarmupPlan) -> float:
    start = time.monotonic()
    try:
        await bounded(_rounds(pool, session, proc, plan), plan.timeout_s)
    except (EngineError, ValueError, TimeoutError) as e:  # warm-up saves time only: the healthy server serves cold
        what = f"no answer within {plan.timeout_s:g} s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
        logger.warning("engine warm-up of %s given up (%s); it serves cold", proc.url, what)
    return time.monotonic() - start


async def _rounds(pool: WarmedPool, session: Any, proc: Any, plan: WarmupPlan) -> None:
    await _one(pool, session, proc, plan)
    await asyncio.gather(*(_one(pool, session, proc, plan) for _ in range(plan.requests)))


async def _one(pool: WarmedPool, session: Any, proc: Any, plan: WarmupPlan) -> None:
    path, body = pool.kind.generate_request(list(plan.prompt_ids), plan.max_tokens, plan.sampling)
    pool.kind.parse_generate(await pool.control.call_one(session, proc.url, HttpCall("POST", path, json=body)))
