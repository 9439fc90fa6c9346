"""Reward sources: how to call each kind once. Limits, retries, timeouts and failure policy are the RewardAgent's.

- `RuleSource` (kind=rule or a dotted path): verl's compute_score signature. Sync functions run in the shared
  ScoringPool under its hard timeout (the worker is killed and replaced); `async def` ones on the caller's loop under
  asyncio's timeout. kind=rule picks the scorer by data_source: the built-in task's, else verl's default_compute_score.
- `JudgeSource` (kind=judge): one chat completion through `Judge`; remote, so transient failures are retried.
- kind=reward_model lives in `fully_async/reward/reward_model.py`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from fully_async.aio import bounded
from fully_async.config import RewardSourceConfig
from fully_async.data import SYNTHETIC_SOURCE
from fully_async.plugins import load
from fully_async.reward.judge import Judge, Reply
from fully_async.reward.workers import ScoringPool

SYNTHETIC_SCORER = "fully_async.reward.rule:synthetic_score"
VERL_SCORER = "verl.utils.reward_score:default_compute_score"


class Source:
    """One configured source. `remote` sources are retried on transient failures; `attempt` is one call."""

    remote = False

    def __init__(self, cfg: RewardSourceConfig, key: str) -> None:
        self.cfg, self.key, self.name = cfg, key, cfg.label

    def estimate_tokens(self, solution: str, meta: dict[str, Any]) -> float:
        """Tokens reserved under the source's TPM limit before a call (settled with the reported usage after)."""
        return 0.0

    async def attempt(self, solution: str, meta: dict[str, Any]) -> Reply:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class RuleSource(Source):
    def __init__(self, cfg: RewardSourceConfig, key: str, pool: ScoringPool) -> None:
        super().__init__(cfg, key)
        self.pool = pool
        self._is_async: dict[str, bool] = {}

    def path_for(self, data_source: str) -> str:
        if self.cfg.kind != "rule":
            return self.cfg.kind
        return SYNTHETIC_SCORER if data_source == SYNTHETIC_SOURCE else VERL_SCORER

    def is_async(self, path: str) -> bool:
        if path not in self._is_async:
            self._is_async[path] = inspect.iscoroutinefunction(load(path, f"{self.key}.kind"))
        return self._is_async[path]

    async def attempt(self, solution: str, meta: dict[str, Any]) -> Reply:
        source = meta.get("data_source", "")
        path = self.path_for(source)
        kwargs = compute_score_kwargs(source, solution, meta.get("ground_truth"), meta.get("extra_info") or {})
        if self.is_async(path):
            out = await bounded(load(path, f"{self.key}.kind")(**kwargs), self.cfg.timeout_s)
        else:
            out = await self.pool.call(path, kwargs, self.cfg.timeout_s)
        score, info = to_score(out)
        return Reply(score, info, None)


class JudgeSource(Source):
    remote = True

    def __init__(self, cfg: RewardSourceConfig, key: str, count_tokens) -> None:
        super().__init__(cfg, key)
        self.judge = Judge(cfg.judge, cfg.timeout_s, key + ".judge")
        self.count_tokens = count_tokens

    def estimate_tokens(self, solution: str, meta: dict[str, Any]) -> float:
        return float(self.count_tokens(self.judge.render(solution, meta)) + self.cfg.judge.max_tokens)

    async def attempt(self, solution: str, meta: dict[str, Any]) -> Reply:
        return await bounded(self.judge.ask(self.judge.render(solution, meta)), self.cfg.timeout_s)

    async def close(self) -> None:
        await self.judge.close()


def compute_score_kwargs(source: str, solution: str, ground_truth: Any, extra: dict) -> dict[str, Any]:
    return {"data_source": source, "solution_str": solution, "ground_truth": ground_truth, "extra_info": extra}


def to_score(out: Any) -> tuple[float, dict[str, Any]]:
    """float | int | {'score': x, ...} -> (score, JSON-simple extras); anything else is a failure."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward dict has no 'score' key: {sorted(out)}")
        score = out["score"]
        info = {k: v for k, v in out.items() if k != "score" and isinstance(v, (bool, int, float, str))}
    else:
        score, info = out, {}
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(float(score)):
        raise ValueError(f"reward score must be a finite number, got {score!r}")
    return float(score), info
