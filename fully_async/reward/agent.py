"""RewardAgent: scores each trajectory as soon as it finishes, with verl's compute_score signature.

Which function scores a row: `reward.function` (dotted path) when set, else by the row's data_source: the built-in
synthetic task's own scorer, or verl's `default_compute_score` (gsm8k, MATH, ...). Synchronous functions run in the
ScoringPool under a hard timeout; `async def` functions run on the caller's loop under asyncio's timeout. A failure
or timeout gives `reward.fallback_score` with the reason flagged in the reward info, never an exception.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fully_async.config import RewardConfig
from fully_async.data import SYNTHETIC_SOURCE, DataError
from fully_async.reward.pool import RewardCallError, RewardTimeout, ScoringPool, resolve

log = logging.getLogger(__name__)

SYNTHETIC_SCORER = "fully_async.reward.rule:synthetic_score"
VERL_SCORER = "verl.utils.reward_score:default_compute_score"


@dataclass
class RewardResult:
    score: float
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable: the function's extra outputs, `reward_s`, and `reward_failed` / `reward_error` flags."""


def scorer_for(cfg: RewardConfig, data_source: str) -> str:
    if cfg.function:
        return cfg.function
    return SYNTHETIC_SCORER if data_source == SYNTHETIC_SOURCE else VERL_SCORER


class RewardAgent:
    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.pool = ScoringPool(cfg.num_workers)
        self._is_async: dict[str, bool] = {}
        self.failures = 0
        self.timeouts = 0

    def _async(self, path: str) -> bool:
        if path not in self._is_async:
            self._is_async[path] = inspect.iscoroutinefunction(resolve(path))
        return self._is_async[path]

    async def check_sources(self, rows: Iterable[Any]) -> None:
        """Fail fast on a data_source no scorer knows, naming the source and the first row that uses it.

        Each distinct source is tried once on an empty answer: only "not implemented" counts as unknown."""
        first: dict[str, str] = {}
        for row in rows:
            first.setdefault(row.data_source, row.origin)
        for source, origin in first.items():
            path = scorer_for(self.cfg, source)
            try:
                resolve(path)
            except (ImportError, AttributeError, ValueError) as e:
                raise DataError(f"reward.function={path!r} cannot be loaded: {e}") from e
            if path != VERL_SCORER:
                continue
            try:
                await self.pool.call(path, _kwargs(source, "", "", {}), self.cfg.timeout_s)
            except RewardCallError as e:
                if "NotImplementedError" in str(e):
                    raise DataError(
                        f"{origin}: unknown data_source {source!r}: verl's default_compute_score has no scorer for "
                        f"it; set reward.function=pkg.module:compute_score"
                    ) from None
            except RewardTimeout:
                pass  # a known source whose scorer is slow on an empty answer: not our concern here

    async def score(self, solution_str: str, meta: dict[str, Any]) -> RewardResult:
        source = meta.get("data_source", "")
        path = scorer_for(self.cfg, source)
        kwargs = _kwargs(source, solution_str, meta.get("ground_truth"), meta.get("extra_info") or {})
        start = time.monotonic()
        try:
            if self._async(path):
                out = await asyncio.wait_for(resolve(path)(**kwargs), self.cfg.timeout_s)
            else:
                out = await self.pool.call(path, kwargs, self.cfg.timeout_s)
            result = _to_result(out)
        except (RewardTimeout, asyncio.TimeoutError):
            self.timeouts += 1
            result = self._fallback(f"timeout after {self.cfg.timeout_s:g}s", path)
        except Exception as e:  # any reward failure becomes a flagged fallback: one bad sample must not stop the run
            self.failures += 1
            result = self._fallback(str(e).splitlines()[-1][:300] if str(e) else repr(e), path)
        result.info["reward_s"] = time.monotonic() - start
        return result

    def _fallback(self, why: str, path: str) -> RewardResult:
        log.warning("reward %s failed (%s); using fallback score %g", path, why, self.cfg.fallback_score)
        return RewardResult(self.cfg.fallback_score, {"reward_failed": True, "reward_error": why})

    def close(self) -> None:
        self.pool.close()


def _kwargs(source: str, solution: str, ground_truth: Any, extra: dict) -> dict[str, Any]:
    return {"data_source": source, "solution_str": solution, "ground_truth": ground_truth, "extra_info": extra}


def _to_result(out: Any) -> RewardResult:
    """float | int | bool | {'score': x, ...} -> RewardResult; anything else is a failure."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward dict has no 'score' key: {sorted(out)}")
        score = out["score"]
        info = {k: v for k, v in out.items() if k != "score" and isinstance(v, (bool, int, float, str))}
    else:
        score, info = out, {}
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(float(score)):
        raise ValueError(f"reward score must be a finite number, got {score!r}")
    return RewardResult(float(score), info)
