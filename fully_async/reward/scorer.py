"""RewardAgent: scores each trajectory as soon as it finishes, combining the configured reward sources.

For every source (`reward.sources`, all scored concurrently): wait for its limiter (concurrency, RPM, TPM; shared
by every process through a named Ray actor), call it under its timeout, retry remote sources on transient failures
(each attempt goes back through the limiter), and on a final failure apply its policy:
- fallback: the source's fallback_score, with `failed` and the reason in reward info;
- drop: raise RewardDrop, and the rollouter re-issues the whole group through the ledger (never lost);
- raise: raise RewardFatal, and the run fails with the message.
The reward is the weighted sum of the source scores. Reward info keeps, per source, its score, latency, attempts and
flags, plus the top-level `reward_failed` / `reward_error` when any source fell back.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tenacity

from fully_async.config import RewardConfig, RewardSourceConfig
from fully_async.config.sections import GROUP_FN_NAME, TEACHER_SOURCE
from fully_async.data import DataError
from fully_async.plugins import load
from fully_async.reward.errors import RewardDrop, RewardFatal
from fully_async.reward.group import GroupScorer
from fully_async.reward.judge import ParseError, RemoteError, WaitRetryAfter, retryable
from fully_async.reward.limiter import RateLimiter, build_limiter
from fully_async.reward.sources import VERL_SCORER, JudgeSource, RuleSource, Source, compute_score_kwargs
from fully_async.reward.workers import RewardCallError, RewardTimeout, ScoringPool

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    score: float
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable: `sources` {name: score, latency_s, attempts, flags...}, `reward_s`, and `reward_failed` /
    `reward_error` when a source fell back."""


COUNTERS = ("calls", "failures", "timeouts", "errors", "retries", "fallbacks", "drops", "parse_failures")


@dataclass
class _Guarded:
    """A source with its limiter and counters."""

    source: Source
    limiter: RateLimiter | None
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    in_flight: int = 0
    latency_s: float = 0.0


def token_counter(path: str | None) -> Callable[[str], int]:
    """Token count of a text for TPM estimates: the tokenizer in `path` (its tokenizer.json through the fast
    `tokenizers` library when there is one, else transformers), or one token per 4 UTF-8 bytes without a path.
    Settlement with the usage the API reports corrects any estimate."""
    if path is None:
        return lambda text: math.ceil(len(text.encode()) / 4)
    fast = Path(path) / "tokenizer.json"
    if fast.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(fast))
        return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    return lambda text: len(hf.encode(text, add_special_tokens=False))


class RewardAgent:
    """`await score(solution_str, meta)` with meta = {data_source, ground_truth, extra_info, question}.

    `tokenizer_path` (the policy's) counts tokens for the TPM estimates of sources that name no tokenizer of their
    own; it is loaded only if such a source exists. Without either, estimates are 4 bytes per token."""

    def __init__(self, cfg: RewardConfig, tokenizer_path: str | None = None) -> None:
        self.cfg = cfg
        group_is_sync = cfg.group_fn is not None and not inspect.iscoroutinefunction(_resolve_group_fn(cfg.group_fn))
        needs_pool = group_is_sync or any(s.kind not in ("judge", "reward_model") for s in cfg.sources)
        self.pool = ScoringPool(cfg.num_workers) if needs_pool else None
        self._tokenizer_path = tokenizer_path
        self.sources: list[_Guarded] = []
        self.group: GroupScorer | None = None
        """reward.group_fn, when set: `await agent.group.apply(trajs, responses, meta, uid)` once per group."""
        self.teacher: Any = None
        """The distillation teacher (fully_async/distill/; None with distill off), once `teacher_ready` returned:
        production scores each sample by it beside the reward; its stats are a source's (`teacher`); closed with
        this agent."""
        self._teacher_start: asyncio.Task | None = None
        try:
            for i, src in enumerate(cfg.sources):
                source = self._build(src, f"reward.sources[{i}]")
                self.sources.append(_Guarded(source, self._limiter(src)))
            if cfg.group_fn is not None:
                self.group = GroupScorer(cfg, self.pool)
        except BaseException:
            self.close()
            raise

    # -- construction ------------------------------------------------------------------------------------------
    def _build(self, src: RewardSourceConfig, key: str) -> Source:
        if src.kind == "judge":
            return JudgeSource(src, key, self._counter(src.judge.tokenizer))
        if src.kind == "reward_model":
            from fully_async.reward.reward_model import build_reward_model_source

            return build_reward_model_source(src, key, self._counter(src.judge.tokenizer), self.cfg.limiter_namespace)
        return RuleSource(src, key, self.pool)

    def _counter(self, path: str | None) -> Callable[[str], int]:
        return token_counter(path or self._tokenizer_path)

    def _limiter(self, src: RewardSourceConfig) -> RateLimiter | None:
        return build_limiter(src.label, src.limits, self.cfg.limiter_namespace, "reward")

    async def check_sources(self, rows: Iterable[Any]) -> None:
        """Fail fast on limits that disagree with the cluster's limiter, and on a data_source no rule scorer knows
        (naming the source and the first row that uses it).

        Each distinct source is tried once on an empty answer: only "not implemented" counts as unknown."""
        for g in self.sources:
            if g.limiter is not None:
                await g.limiter.check(g.source.name)
        first: dict[str, str] = {}
        for row in rows:
            first.setdefault(row.data_source, row.origin)
        for g in self.sources:
            if not isinstance(g.source, RuleSource):
                continue
            for source, origin in first.items():
                path = g.source.path_for(source)
                try:
                    load(path, f"{g.source.key}.kind")
                except (ImportError, AttributeError, ValueError) as e:
                    raise DataError(f"{g.source.key}.kind={path!r} cannot be loaded: {e}") from e
                if path != VERL_SCORER:
                    continue
                try:
                    await self.pool.call(path, compute_score_kwargs(source, "", "", {}), g.source.cfg.timeout_s)
                except RewardCallError as e:
                    if "NotImplementedError" in str(e):
                        raise DataError(
                            f"{origin}: unknown data_source {source!r}: verl's default_compute_score has no scorer "
                            f"for it; set {g.source.key}.kind=pkg.module:compute_score"
                        ) from None
                except RewardTimeout:
                    pass  # a known source whose scorer is slow on an empty answer: not our concern here

    # -- scoring -----------------------------------------------------------------------------------------------
    async def score(self, solution_str: str, meta: dict[str, Any]) -> RewardResult:
        start = time.monotonic()
        outs = await asyncio.gather(
            *(self._score_one(g, solution_str, meta) for g in self.sources), return_exceptions=True
        )
        for out in outs:  # every source has finished: nothing is left running when a policy error propagates
            if isinstance(out, BaseException):
                raise out
        total, per_source, failed = 0.0, {}, []
        for g, (score, info) in zip(self.sources, outs):
            total += g.source.cfg.weight * score
            per_source[g.source.name] = info
            if info.get("failed"):
                failed.append(f"{g.source.name}: {info['error']}")
        result = RewardResult(total, {"sources": per_source})
        if len(self.sources) == 1:  # one source: its function's extra outputs (acc, pred, ...) stay at the top
            result.info.update({k: v for k, v in outs[0][1].items() if k not in _OWN_KEYS})
        if failed:
            result.info["reward_failed"] = True
            result.info["reward_error"] = "; ".join(failed)[:500]
        result.info["reward_s"] = time.monotonic() - start
        return result

    async def _score_one(self, g: _Guarded, solution: str, meta: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        start = time.monotonic()
        tally = _Tally()
        g.counts["calls"] += 1
        g.in_flight += 1
        try:
            retrying = self._retrying(g)
            if retrying is not None:
                reply = await retrying(self._attempt, g, solution, meta, tally)
            else:
                reply = await self._attempt(g, solution, meta, tally)
            info = {"score": reply.score, **reply.info}
            score = reply.score
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failing source is handled by its policy: one bad sample must not stop the run
            score, info = self._on_failure(g, e)
        finally:
            g.in_flight -= 1
        latency = time.monotonic() - start
        g.latency_s += latency
        info.update({"latency_s": latency, "attempts": tally.attempts})
        if g.limiter is not None:
            info["limiter_wait_s"] = tally.wait_s
        return score, info

    @staticmethod
    async def _attempt(g: _Guarded, solution: str, meta: dict[str, Any], tally: _Tally) -> Any:
        """One call of the source through its limiter, settling the tokens it used (none when refused early)."""
        src = g.source
        tally.attempts += 1
        permit = None
        if g.limiter is not None:
            permit = await g.limiter.acquire(src.estimate_tokens(solution, meta))
            tally.wait_s += permit.wait_s
        used = None
        try:
            reply = await src.attempt(solution, meta)
            used = reply.used_tokens
            return reply
        except ParseError as e:
            used = getattr(e, "used_tokens", None)
            raise
        except RemoteError as e:
            if e.status is not None:
                used = 0.0  # refused or failed by the server before any generation
            raise
        except (RewardTimeout, asyncio.TimeoutError):
            g.counts["timeouts"] += 1
            raise
        finally:
            if permit is not None:
                g.limiter.release(permit, used)

    @staticmethod
    def _retrying(g: _Guarded) -> tenacity.AsyncRetrying | None:
        """The retry policy of a remote source with retries (None: one attempt)."""
        cfg = g.source.cfg
        if not (g.source.remote and cfg.retries):
            return None

        def before_sleep(state: tenacity.RetryCallState) -> None:
            g.counts["retries"] += 1

        return tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(cfg.retries + 1),
            wait=WaitRetryAfter(cfg.backoff_s, cfg.backoff_max_s),
            # A server that asks for a longer pause than backoff_max_s ends the retries (the policy applies)
            # rather than being retried early or stalling the sample for as long as it says.
            retry=tenacity.retry_if_exception(
                lambda e: retryable(e) and (getattr(e, "retry_after", None) or 0.0) <= cfg.backoff_max_s
            ),
            before_sleep=before_sleep,
            reraise=True,
        )

    def _on_failure(self, g: _Guarded, e: Exception) -> tuple[float, dict[str, Any]]:
        cfg = g.source.cfg
        if isinstance(e, (RewardTimeout, asyncio.TimeoutError)):
            why = f"timeout after {cfg.timeout_s:g}s"
        else:
            why = (str(e).strip().splitlines() or [repr(e)])[-1][:300]
            g.counts["errors"] += 1
            if isinstance(e, ParseError):
                g.counts["parse_failures"] += 1
        g.counts["failures"] += 1
        if cfg.on_failure == "drop":
            g.counts["drops"] += 1
            log.warning("reward source %s failed (%s); dropping the sample's group for re-issue", g.source.name, why)
            raise RewardDrop(f"reward source {g.source.name!r} failed ({why}); on_failure=drop") from None
        if cfg.on_failure == "raise":
            raise RewardFatal(
                f"reward source {g.source.name!r} failed ({why}) and {g.source.key}.on_failure=raise"
            ) from None
        g.counts["fallbacks"] += 1
        log.warning("reward source %s failed (%s); using fallback score %g", g.source.name, why, cfg.fallback_score)
        info = {"score": cfg.fallback_score, "failed": True, "error": why}
        if isinstance(e, ParseError):
            info["parse_failed"] = True
        return cfg.fallback_score, info

    # -- stats and shutdown ------------------------------------------------------------------------------------
    @property
    def timeouts(self) -> int:
        return int(sum(g.counts["timeouts"] for g in self.sources))

    @property
    def failures(self) -> int:
        return int(sum(g.counts["failures"] for g in self.sources))

    def stats(self) -> dict[str, dict[str, float]]:
        """Cumulative counters per source, plus its current in-flight calls, limiter wait and realized rates."""
        out = {}
        for g in self.sources:
            s: dict[str, float] = {**g.counts, "in_flight": g.in_flight, "latency_s": g.latency_s}
            if g.limiter is not None:
                rpm, tpm = g.limiter.realized()
                s.update(
                    {"limiter_wait_s": g.limiter.wait_s, "limiter_acquired": g.limiter.acquired,
                     "limiter_actor_calls": g.limiter.actor_calls, "limiter_rate_calls": g.limiter.rate_calls, "realized_rpm": rpm, "realized_tpm": tpm}
                )  # fmt: skip
            out[g.source.name] = s
        if self.group is not None:
            out[GROUP_FN_NAME] = self.group.stats()
        if self.teacher is not None:
            out[TEACHER_SOURCE] = self.teacher.stats()
        return out

    def close(self) -> None:
        for g in self.sources:
            if g.limiter is not None:
                g.limiter.shutdown()
            closer = g.source.close()
            try:
                asyncio.get_running_loop().create_task(closer)
            except RuntimeError:  # no loop left: the HTTP clients go with the process
                closer.close()
        self.sources = []
        if self.pool is not None:
            self.pool.close()

    def start_teacher(self, starting: Any) -> None:
        """Begin the distillation teacher's start (the coroutine `starting`: fully_async/distill/ `start_teacher`) in
        the background, so its servers start beside the rollout's; `teacher_ready` waits for it."""
        self._teacher_start = asyncio.get_running_loop().create_task(starting)

    async def teacher_ready(self) -> None:
        """Wait for the teacher's start (a no-op without one) and hold the teacher; its failure raises here."""
        if self._teacher_start is not None:
            self.teacher = await self._teacher_start

    async def aclose(self) -> None:
        """close() from inside an event loop, waiting for the sources' HTTP clients to close (and the teacher's
        servers to stop, a start still under way cancelled first)."""
        if self._teacher_start is not None:
            if not self._teacher_start.done():
                self._teacher_start.cancel()
            started = (await asyncio.gather(self._teacher_start, return_exceptions=True))[0]
            self.teacher = None if isinstance(started, BaseException) else started  # started but never awaited
            self._teacher_start = None
        if self.teacher is not None:
            teacher, self.teacher = self.teacher, None
            await teacher.aclose()
        for g in self.sources:
            if g.limiter is not None:
                g.limiter.shutdown()
            await g.source.close()
        self.sources = []
        if self.pool is not None:
            self.pool.close()


@dataclass
class _Tally:
    """One sample's calls of one source, across its retries."""

    attempts: int = 0
    wait_s: float = 0.0


def _resolve_group_fn(path: str):
    try:
        return load(path, "reward.group_fn")
    except (ImportError, AttributeError, ValueError) as e:
        raise DataError(f"reward.group_fn={path!r} cannot be loaded: {e}") from e


_OWN_KEYS = ("score", "latency_s", "attempts", "limiter_wait_s", "failed", "error", "parse_failed")
