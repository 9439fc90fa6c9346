"""TeacherScorer: the teacher's log-prob of every response token of a finished sample, one request per training row.

Contract:
- `await score(rows)` sets `row.teacher_logprobs` (float32, one per response token) on every row of one sample, or
  raises: it never leaves a row half scored and never invents a value. Each row is one request: its prompt +
  response ids scored together (prompt log-probs of the whole sequence; the response's part is kept), so the
  teacher sees exactly the token ids the student saw, tool and environment tokens included as context (they carry
  no signal in the loss: their mask is 0).
- A call goes through the reward path's machinery: the `teacher` limiter (distill.limits: concurrency, RPM, TPM,
  held across the cluster by a named Ray actor; tokens = prompt + response, settled with the usage the server
  reports), `distill.timeout_s` per attempt, `distill.retries` retries of transient failures (connection lost, 5xx,
  408 / 429, a malformed 200, a timeout), each attempt back through the limiter, with backoff. A server found dead
  is handed to the teacher pool's recovery (restarted in the background) and the retry goes to another one.
- A call that still fails raises `TeacherFailed` (a `RewardDrop`: production re-issues the sample's group, counted
  like an environment's infrastructure failure) or, with distill.on_failure=raise, `RewardFatal`. The failure is
  never turned into a signal.
- `stats()` has the reward sources' counter names (calls, failures, retries, drops, latency_s, limiter_wait_s, ...)
  plus `tokens_scored` and `clock_s`, so the trainer's reward-source metrics report it as `fully_async/reward/teacher`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tenacity

from fully_async.aio import bounded
from fully_async.config import DistillConfig
from fully_async.config.sections import TEACHER_SOURCE
from fully_async.reward import RewardDrop, RewardFatal
from fully_async.reward.judge import RemoteError, WaitRetryAfter, post_json, retryable
from fully_async.reward.limiter import RateLimiter, build_limiter

log = logging.getLogger(__name__)

COUNTERS = ("calls", "failures", "timeouts", "errors", "retries", "drops", "requests", "tokens_scored")


class TeacherFailed(RewardDrop):
    """A teacher call failed after its retries: the sample's group is re-issued (never trained on a made-up value)."""


@dataclass
class TeacherEndpoint:
    """How to ask one kind of teacher server for prompt log-probs: `path` and `body(ids)`, and where the answer's
    per-position entries are (`entries(body)`)."""

    path: str
    model: str | None = None

    def body(self, ids: list[int]) -> dict[str, Any]:
        if self.path.endswith("/completions"):  # an OpenAI-compatible server (vLLM's prompt_logprobs extension)
            return {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        return {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
                                                      "detokenize": False}}  # fmt: skip

    def entries(self, body: Any) -> list:
        if self.path.endswith("/completions"):
            return body["choices"][0]["prompt_logprobs"]
        return body["prompt_logprobs"]


ENGINE_ENDPOINT = TeacherEndpoint("/inference/v1/generate")
"""The teacher's own vLLM servers: the token-in endpoint the rollout engines use (scale-out mode)."""


def response_logprobs(entries: Any, ids: Sequence[int], prompt_len: int) -> np.ndarray:
    """The log-probs of ids[prompt_len:] from a server's prompt log-probs (one entry per position, None first: a dict
    keyed by the token id, as a string in JSON, holding {"logprob": x} or x). Raises RemoteError when the answer
    does not hold them (a server that ignored prompt_logprobs, or answered for other ids)."""
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise RemoteError(f"teacher returned {got} prompt log-prob entries for {len(ids)} tokens")
    out = np.empty(len(ids) - prompt_len, dtype=np.float32)
    for k, pos in enumerate(range(prompt_len, len(ids))):
        entry = entries[pos]
        value = entry.get(str(ids[pos]), entry.get(ids[pos])) if isinstance(entry, dict) else None
        if isinstance(value, dict):
            value = value.get("logprob")
        if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
            raise RemoteError(f"teacher's prompt log-probs have no value for token {ids[pos]} at position {pos}")
        out[k] = float(value)
    return out


class TeacherScorer:
    """Scores samples on the teacher servers at `urls` (base URLs) through `endpoint`. `pool`: the teacher's
    `EngineServers` with its `Recovery` (`recovery`), or None for a server the run does not own (distill.teacher.url)."""

    def __init__(self, cfg: DistillConfig, urls: Sequence[str], endpoint: TeacherEndpoint, namespace: str,
                 *, headers: dict[str, str] | None = None, recovery: Any = None) -> None:  # fmt: skip
        self.cfg, self.urls, self.endpoint = cfg, [u.rstrip("/") for u in urls], endpoint
        self.headers = headers or {}
        self.recovery = recovery
        self.limiter: RateLimiter | None = build_limiter(TEACHER_SOURCE, cfg.limits, namespace, "reward")
        self.counts: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.latency_s = 0.0
        self.in_flight = 0
        self.outstanding = [0] * len(self.urls)
        self.down: set[int] = set()
        self._session: Any = None

    # -- one sample --------------------------------------------------------------------------------------------
    async def score(self, rows: Sequence[Any]) -> None:
        """Every row's teacher log-probs (module docstring), or TeacherFailed / RewardFatal."""
        start = time.monotonic()
        self.counts["calls"] += 1
        self.in_flight += 1
        try:
            scored = [await self._row(r) for r in rows]  # rows of one sample: few, and each on the limiter
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the policy decides; a failure is never a score
            self._fail(e)
        finally:
            self.in_flight -= 1
            self.latency_s += time.monotonic() - start
        for row, values in zip(rows, scored):
            row.teacher_logprobs = values
        self.counts["tokens_scored"] += sum(len(v) for v in scored)

    async def _row(self, row: Any) -> np.ndarray:
        ids = [int(x) for x in row.prompt_ids] + [int(x) for x in row.response_ids]
        if not len(row.response_ids):
            return np.zeros(0, dtype=np.float32)
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.cfg.retries + 1),
            wait=WaitRetryAfter(self.cfg.backoff_s, self.cfg.backoff_max_s),
            retry=tenacity.retry_if_exception(retryable),
            before_sleep=lambda state: self.counts.__setitem__("retries", self.counts["retries"] + 1),
            reraise=True,
        )
        return await retrying(self._attempt, ids, len(row.prompt_ids))

    async def _attempt(self, ids: list[int], prompt_len: int) -> np.ndarray:
        permit = await self.limiter.acquire(float(len(ids))) if self.limiter is not None else None
        used = None
        try:
            values, used = await bounded(self._post(ids, prompt_len), self.cfg.timeout_s)
            return values
        except (asyncio.TimeoutError, TimeoutError):
            self.counts["timeouts"] += 1
            raise TimeoutError(f"teacher call timed out after {self.cfg.timeout_s:g}s") from None
        finally:
            if permit is not None:
                self.limiter.release(permit, used)

    async def _post(self, ids: list[int], prompt_len: int) -> tuple[np.ndarray, float | None]:
        import aiohttp

        if self._session is None:
            # No connection cap (aiohttp's default is 100): distill.limits.max_concurrent is the cap. With aiohttp's,
            # a slow teacher queued calls here unseen, and the pipeline ran at 100 / latency calls per second.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        idx = self._pick()
        self.outstanding[idx] += 1
        self.counts["requests"] += 1
        try:
            body = await post_json(self._session, self.urls[idx] + self.endpoint.path, self.endpoint.body(ids),
                                   "teacher", self.headers, lambda: self._maybe_dead(idx))  # fmt: skip
        finally:
            self.outstanding[idx] -= 1
        try:
            entries = self.endpoint.entries(body)
        except (KeyError, IndexError, TypeError) as e:
            raise RemoteError(f"teacher's answer holds no prompt log-probs ({type(e).__name__}: {e})") from None
        usage = (body.get("usage") or {}).get("prompt_tokens") if isinstance(body, dict) else None
        return response_logprobs(entries, ids, prompt_len), usage

    def _pick(self) -> int:
        """The least busy server not known to be down (all down: the least busy, whose failure is the retry's)."""
        up = [i for i in range(len(self.urls)) if i not in self.down] or list(range(len(self.urls)))
        return min(up, key=self.outstanding.__getitem__)

    async def _maybe_dead(self, idx: int) -> None:
        """A connection failed: with a pool the run owns, ask its recovery whether the server died (then it is
        restarted in the background and skipped meanwhile)."""
        if self.recovery is None:
            return
        if await self.recovery.on_failure(idx):
            self.down.add(idx)
            asyncio.get_running_loop().create_task(self._back_when_serving(idx))

    async def _back_when_serving(self, idx: int) -> None:
        servers = self.recovery.servers
        while not servers.closed and idx not in servers.serving:
            await asyncio.sleep(0.5)
        self.down.discard(idx)

    def _fail(self, e: Exception) -> None:
        if isinstance(e, TimeoutError):
            why = str(e) or f"timeout after {self.cfg.timeout_s:g}s"
        else:
            self.counts["errors"] += 1
            why = (str(e).strip().splitlines() or [repr(e)])[-1][:300]
        self.counts["failures"] += 1
        if self.cfg.on_failure == "raise":
            raise RewardFatal(f"the distillation teacher failed ({why}) and distill.on_failure=raise") from None
        self.counts["drops"] += 1
        log.warning("distillation teacher failed (%s); re-issuing the sample's group", why)
        raise TeacherFailed(f"the distillation teacher failed ({why}); its group is re-issued") from None

    # -- stats and shutdown ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Cumulative counters in the reward sources' names (module docstring)."""
        out: dict[str, float] = {**self.counts, "in_flight": self.in_flight, "latency_s": self.latency_s,
                                 "clock_s": time.monotonic()}  # fmt: skip
        if self.limiter is not None:
            rpm, tpm = self.limiter.realized()
            out.update({"limiter_wait_s": self.limiter.wait_s, "limiter_acquired": self.limiter.acquired,
                        "realized_rpm": rpm, "realized_tpm": tpm})  # fmt: skip
        return out

    async def aclose(self) -> None:
        if self.limiter is not None:
            self.limiter.shutdown()
        if self._session is not None:
            await self._session.close()
            self._session = None
