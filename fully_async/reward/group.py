"""Group-level reward post-processing (`reward.group_fn`): one call per prompt group, after every sample of the group
is scored and before the group enters the queue (ranking or pairwise judges, length penalties relative to the group,
majority-vote pseudo labels).

The function gets the whole group as plain data and returns one reward per sample, optionally with info:

    fn(group: dict) -> list[float] | tuple[list[float], dict | list[dict]]      (called as fn(group=...))
    group = {"prompt_uid", "data_source", "ground_truth", "extra_info", "question",
             "samples": [{"sample_index", "response", "reward", "reward_info", "response_length", "finish_reason"}]}

A sync function runs in the reward ScoringPool under its hard timeout (the worker is killed when it passes); an
`async def` one runs on the rollouter's loop under asyncio's timeout. Each sample keeps its own reward info; its
per-sample score moves to `reward_info["sample_score"]` and the call's info (latency, the function's info, or the
failure) goes to `reward_info["group_fn"]`. On a failure (exception, timeout, wrong number of rewards, a non-finite
reward) `reward.group_fn_on_failure` applies: fallback keeps the per-sample scores (flagged), drop raises RewardDrop
(the rollouter re-issues the group), raise raises RewardFatal (the run fails).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from fully_async.aio import bounded
from fully_async.config import RewardConfig
from fully_async.config.sections import GROUP_FN_NAME as NAME
from fully_async.plugins import load
from fully_async.reward.errors import RewardDrop, RewardFatal
from fully_async.reward.workers import RewardTimeout, ScoringPool

log = logging.getLogger(__name__)


class GroupFnError(ValueError):
    """The group function returned something other than one finite reward per sample (and optional info)."""


class GroupScorer:
    """Runs `reward.group_fn` on finished groups with its timeout and failure policy; counts what happened."""

    def __init__(self, cfg: RewardConfig, pool: ScoringPool | None) -> None:
        self.path = cfg.group_fn
        self.timeout_s = cfg.group_fn_timeout_s
        self.on_failure = cfg.group_fn_on_failure
        self.is_async = inspect.iscoroutinefunction(load(self.path, "reward.group_fn"))
        if not self.is_async and pool is None:
            raise ValueError("a sync reward.group_fn needs the reward ScoringPool")
        self.pool = pool
        self.counts = dict.fromkeys(("calls", "failures", "timeouts", "errors", "fallbacks", "drops"), 0)
        self.in_flight = 0
        self.latency_s = 0.0

    async def apply(self, trajs: Sequence[Any], responses: Sequence[str], meta: dict[str, Any], uid: str) -> None:
        """Re-score `trajs` (one group, each already scored) in place. Raises RewardDrop / RewardFatal by policy."""
        group = {
            "prompt_uid": uid,
            **{k: meta.get(k) for k in ("data_source", "ground_truth", "extra_info", "question")},
            "samples": [
                {"sample_index": t.sample_index, "response": text, "reward": float(t.reward),
                 "reward_info": dict(t.reward_info or {}), "response_length": int(t.response_length),
                 "finish_reason": t.finish_reason}
                for t, text in zip(trajs, responses, strict=True)
            ],
        }  # fmt: skip
        self.counts["calls"] += 1
        self.in_flight += 1
        start = time.monotonic()
        try:
            if self.is_async:
                out = await bounded(load(self.path, "reward.group_fn")(group=group), self.timeout_s)
            else:
                out = await self.pool.call(self.path, {"group": group}, self.timeout_s)
            rewards, infos = _parse(out, len(trajs))
            failure = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the group's policy decides; one bad group must not stop the run
            failure = e
        finally:
            self.in_flight -= 1
            latency = time.monotonic() - start
            self.latency_s += latency
        if failure is not None:
            timed_out = isinstance(failure, RewardTimeout | asyncio.TimeoutError)
            why = f"timeout after {self.timeout_s:g}s" if timed_out else _last_line(failure)
            self.counts["failures"] += 1
            self.counts["timeouts" if timed_out else "errors"] += 1
            if self.on_failure == "drop":
                self.counts["drops"] += 1
                log.warning("reward.group_fn failed on group %s (%s); re-issuing the group", uid, why)
                raise RewardDrop(f"reward.group_fn failed on group {uid} ({why}); group_fn_on_failure=drop")
            if self.on_failure == "raise":
                raise RewardFatal(f"reward.group_fn failed on group {uid} ({why}) and group_fn_on_failure=raise")
            self.counts["fallbacks"] += 1
            log.warning("reward.group_fn failed on group %s (%s); keeping the per-sample scores", uid, why)
            for t in trajs:
                t.reward_info = {**(t.reward_info or {}), NAME: {"failed": True, "error": why, "latency_s": latency}}
            return
        for t, reward, info in zip(trajs, rewards, infos, strict=True):
            t.reward_info = {**(t.reward_info or {}), "sample_score": float(t.reward),
                             NAME: {**info, "latency_s": latency}}  # fmt: skip
            t.reward = reward

    def stats(self) -> dict[str, float]:
        return {**self.counts, "in_flight": self.in_flight, "latency_s": self.latency_s}


def _parse(out: Any, n: int) -> tuple[list[float], list[dict[str, Any]]]:
    info: Any = {}
    if isinstance(out, tuple):
        if len(out) != 2:
            raise GroupFnError(f"group_fn must return rewards or (rewards, info), got a tuple of {len(out)}")
        out, info = out
    if isinstance(out, str | bytes) or not isinstance(out, Sequence) or len(out) != n:
        raise GroupFnError(f"group_fn must return one reward per sample ({n}), got {out!r:.200}")
    rewards = []
    for r in out:
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(float(r)):
            raise GroupFnError(f"group_fn rewards must be finite numbers, got {r!r}")
        rewards.append(float(r))
    if isinstance(info, dict):
        infos = [dict(info)] * n
    elif isinstance(info, Sequence) and len(info) == n and all(isinstance(i, dict) for i in info):
        infos = [dict(i) for i in info]
    else:
        raise GroupFnError(f"group_fn info must be a dict or one dict per sample ({n}), got {info!r:.200}")
    return rewards, infos


def _last_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [repr(e)])[-1][:300]
