"""Async client over a pool of engine servers: least-outstanding balancing, abort/continue, retries, versions.

Contract of `generate(prompt_ids, max_tokens)`: the result never holds more than max_tokens tokens, whatever happens
in between. A pause that aborts the request returns its tokens so far; the client waits for the resume and sends
prompt + tokens so far with the remaining budget, so each token keeps the version of the weights that produced it
(the engine's own label where it reports one, else the control plane's version when the segment was sent). Under
async_training.on_sync recompute or keep a sync freezes requests instead of aborting them: they are not re-sent, and
their tokens keep the engine's per-token labels (fully_async/engines/inflight.py: cache versions, re-prefill counts,
the cache salt). A server failure (connection lost, 5xx, malformed response, timeout) re-sends the same continuation
to another server, up to engine.max_retries times; then EngineError names the server and its log. A 4xx is the
request's fault: not retried.

Behind a router (engine.router) every request goes to the router, which picks the server; the client still picks a
slot per request, but only to account for it (outstanding, busy seconds, trace spans): the response does not say which
server ran it. A failure through the router restarts a dead router and looks at every server for dead ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from fully_async.aio import bounded
from fully_async.engines.affinity import Affinity
from fully_async.engines.auth import auth_headers
from fully_async.engines.errors import EngineError
from fully_async.engines.inflight import record_continuation, record_segment, salt_fields, wait_resumed
from fully_async.engines.pool import EngineServers
from fully_async.engines.prefix_cache import PrefixCacheCounts
from fully_async.engines.recovery import Recovery
from fully_async.engines.slots import SlotState
from fully_async.engines.types import GenerationResult, Sampling, Segment

logger = logging.getLogger(__name__)

MAX_ABORTS = 1000
"""Aborts one request may see before it is failed: a guard against an endless abort loop, not a tuning knob."""


class _ServerFailure(Exception):
    """The server, not the request, failed: worth a retry elsewhere."""


@dataclass
class ClientStats:
    requests: int = 0
    segments: int = 0
    aborts: int = 0
    carried_tokens: int = 0
    """Tokens of aborted segments kept and continued under newer weights (partial rollout)."""
    frozen_requests: int = 0
    """Requests that outlived a sync without being aborted (on_sync recompute or keep; engines/inflight.py)."""
    client_reprefill_tokens: int = 0
    """Prompt + kept tokens of requests a sync aborted, sent again: prefilled again by the engine."""
    engine_reprefill_tokens: int = 0
    """Tokens the engines prefilled again inside themselves for frozen requests (on_sync=recompute)."""
    retries: int = 0
    restarts: int = 0
    moved: int = 0
    """Requests aborted by a server leaving the pool and continued (or restarted) on the others."""


class EngineClient:
    """One per event loop; shares one aiohttp session across all requests. Call `close()` when done."""

    def __init__(
        self,
        servers: EngineServers,
        *,
        request_timeout_s: float | None = None,
        max_retries: int | None = None,
        resume_timeout_s: float | None = None,
        auto_restart: bool | None = None,
    ):
        cfg = servers.cfg
        self.servers = servers
        self.request_timeout_s = request_timeout_s or cfg.request_timeout_s
        self.max_retries = cfg.max_retries if max_retries is None else max_retries
        self.resume_timeout_s = resume_timeout_s or cfg.resume_timeout_s
        self.outstanding = [0] * len(servers.addresses)
        self.stats = ClientStats()
        self.recovery = Recovery(servers, cfg.auto_restart if auto_restart is None else auto_restart, self.stats)
        """Marks servers that died down and brings them back in the background (recovery.py)."""
        servers.on_dead = self.recovery.schedule_restart
        self._session: aiohttp.ClientSession | None = None
        self._next = 0
        # Sticky routing per episode (engines/affinity.py); cached prompt tokens per server (engines/prefix_cache.py).
        self.affinity, self.prefix_cache = Affinity(), PrefixCacheCounts()
        # Engine occupancy for the idle ratio: wall seconds each server had >= 1 request in flight.
        self._busy_s = [0.0] * len(servers.addresses)
        self._busy_since: list[float | None] = [None] * len(servers.addresses)
        self.on_segment: Callable[[int, float, float, int, str], None] | None = None
        """Called after every generate request with (server index, wall start, wall end, tokens, finish reason);
        the rollouter records it as a trace span."""

    @property
    def down(self) -> frozenset[int]:
        """Servers whose process died, skipped until restarted (the pool's slots: its control plane skips them too)."""
        return self.servers.down

    @property
    def retired(self) -> frozenset[int]:
        """Servers removed from the pool (elastic engines): never picked again; their slot index is not reused."""
        return self.servers.retired

    def grow(self) -> None:
        """Servers appended to the pool (elastic engines) start taking requests: counters for each."""
        for _ in range(len(self.servers.procs) - len(self.outstanding)):
            self.outstanding.append(0)
            self._busy_s.append(0.0)
            self._busy_since.append(None)

    def retire(self, idx: int) -> None:
        """Server `idx` takes no new request from now on; requests it aborts continue on the others."""
        self.servers.retire(idx)

    async def remove_server(self, idx: int, drain_timeout_s: float) -> int:
        """Take server `idx` out of the pool (elastic engines): no new requests go to it, what it still runs is
        aborted and continued on the others (from the prompt when partial rollout is off), then it is stopped and
        its host freed. Waits up to `drain_timeout_s` for its requests to move. Returns how many moved."""
        moved = self.stats.moved
        self.retire(idx)

        async def drained() -> None:
            deadline = time.monotonic() + drain_timeout_s
            while self.outstanding[idx] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if self.outstanding[idx]:
                logger.warning("%d request(s) still on %s after %g s; stopping it anyway (they retry elsewhere)",
                               self.outstanding[idx], self.servers.address(idx), drain_timeout_s)  # fmt: skip

        await self.servers.remove(idx, drained)
        return self.stats.moved - moved

    def busy_seconds(self) -> list[float]:
        """Per server: wall seconds with at least one generate request in flight, up to now."""
        now = time.time()
        return [b + (now - s if s is not None else 0.0) for b, s in zip(self._busy_s, self._busy_since)]

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap: concurrency is bounded by the rollouter, and a cap here would queue requests
            # invisibly to the balancer.
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=auth_headers())
        return self._session

    async def close(self) -> None:
        self.recovery.close()
        if self._session is not None:
            await self._session.close()

    # ---- balancing -------------------------------------------------------------------------------------------------
    def pick(self, exclude: int | None = None) -> int:
        """The live server with the fewest outstanding requests (ties rotate); `exclude` only if it is the last one."""
        if len(self.outstanding) != len(self.servers.procs):
            self.grow()
        n = len(self.outstanding)
        slots = self.servers.slots
        if exclude is None and slots.all_serving:
            # The common case in O(n) C-level scans: at hundreds of servers the general path below costs more than
            # the rest of a request. The first least-loaded server at or after _next, as the general path picks.
            least = min(self.outstanding)
            try:
                best = self.outstanding.index(least, self._next)
            except ValueError:
                best = self.outstanding.index(least)
            self._next = (best + 1) % n
            return best
        order = [i for i in ((self._next + k) % n for k in range(n)) if slots[i] is not SlotState.RETIRED]
        if not order:
            raise EngineError("no engine server left in the pool (all were removed)")
        serving = [i for i in order if slots[i] is SlotState.SERVING]
        # A stale server (restarted on old weights, waiting for the next sync) is never picked: its tokens would be
        # labelled with a version it does not hold. A down one only when nothing serves (the send fails and retries).
        for candidates in (
            [i for i in serving if i != exclude],
            serving,
            [i for i in order if slots[i] is not SlotState.STALE],
        ):
            if candidates:
                break
        else:
            raise EngineError("every engine server is waiting for the next weight sync (restarted on old weights)")
        best = min(candidates, key=lambda i: self.outstanding[i])
        self._next = (best + 1) % n
        return best

    def idle(self) -> bool:
        """Whether no request of this client is in flight on any server (counted from just before it is sent until
        its answer)."""
        return not any(self.outstanding)

    # ---- generation ------------------------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: Sampling = Sampling(),
        continue_on_abort: bool = True,
        images: list[bytes] | None = None,
    ) -> GenerationResult:
        """`continue_on_abort=False` (partial_rollout off): a request aborted by a pause drops its tokens and starts
        again from the prompt after the resume, with the full budget, so every token comes from one version.
        `images`: the prompt's images (PNG bytes), one per image token in prompt_ids; every segment, a continuation
        after an abort included, sends them again with the prompt (docs/vlm.md)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        state = self.servers.state
        self.stats.requests += 1
        result = GenerationResult([], [], [], "length", start_version=state.version)
        failed: int | None = None
        while len(result.token_ids) < max_tokens:
            if state.paused:
                await wait_resumed(self.servers, None, self.resume_timeout_s)
            idx = self.affinity.pick(self, exclude=failed)
            url = self.servers.generate_url(idx)
            sent_version, sent = state.version, list(prompt_ids) + result.token_ids
            try:
                seg = await self._send(
                    idx,
                    sent,
                    max_tokens - len(result.token_ids),
                    sampling,
                    sent_version,
                    images,
                )
            except _ServerFailure as e:
                failed = idx
                await self._retry_after(idx, url, e, result)
                continue
            failed = None
            take = min(len(seg.token_ids), max_tokens - len(result.token_ids))  # never past the budget
            adapters = self.servers.weights.adapters is not None
            _append(result, seg, take, _labels(seg, sent_version, adapters), sent_version)
            record_segment(self.stats, state.on_sync, result, seg, take, sent_version, len(sent))
            result.servers.append(url)
            if seg.finish_reason != "abort":
                result.finish_reason = "length" if seg.finish_reason == "length" else "stop"
                break
            await self._resume_after_abort(idx, url, result, len(prompt_ids), take, continue_on_abort)
        return result

    async def _retry_after(self, idx: int, url: str, e: Exception, result: GenerationResult) -> None:
        """A failure of server `idx`: counted, and the request waits for a server to retry on; past
        engine.max_retries it fails with the server's log tail."""
        dead = await self.recovery.on_failure(idx)
        result.num_retries += 1
        self.stats.retries += 1
        if result.num_retries > self.max_retries:
            log = self.servers.log_for(url)
            # In a thread: a server on an engine host reads its log with a Ray call, not on this loop.
            tail = await asyncio.to_thread(self.servers.log_tail, idx, 15)
            raise EngineError(
                f"generate failed {result.num_retries} times (engine.max_retries={self.max_retries}); "
                f"last failure on {url}: {e}; log {log}:\n{tail}"
            ) from e
        if not dead:  # a dead server's failures are counted in its "died" / "is back" lines
            logger.warning("retrying a request after a failure on %s: %s", url, e)
        await self.recovery.wait_for_a_server()

    async def _resume_after_abort(
        self, idx: int, url: str, result: GenerationResult, prompt: int, take: int, continue_on_abort: bool
    ) -> None:
        """A segment aborted by a pause (or its server leaving): wait for the resume, then keep its `take` tokens
        (partial rollout) or drop every token so far."""
        state = self.servers.state
        result.num_aborts += 1
        self.stats.aborts += 1
        if result.num_aborts > MAX_ABORTS:
            raise EngineError(f"request aborted {result.num_aborts} times; last by {url}")
        if (
            self.servers.slots[idx] is SlotState.RETIRED
        ):  # its server left the pool: go on elsewhere now, not after a resume
            self.stats.moved += 1
            if state.paused:
                await wait_resumed(self.servers, None, self.resume_timeout_s)
        else:
            await wait_resumed(self.servers, idx, self.resume_timeout_s)
        if not continue_on_abort:
            del result.token_ids[:], result.logprobs[:], result.versions[:]
            result.cache_versions = None
            result.start_version = state.version
        else:
            self.stats.carried_tokens += take
        record_continuation(self.stats, prompt, len(result.token_ids))

    async def _send(
        self, idx: int, prompt: list[int], max_tokens: int, sampling: Sampling, version: int, images=None
    ) -> Segment:
        """One generate call on server `idx`; with adapters, under the adapter of `version` (counted in use until the
        answer, so that no sync unloads it meanwhile)."""
        url = self.servers.generate_url(idx)
        adapters = self.servers.weights.adapters
        adapter = adapters.acquire(version) if adapters is not None else None
        start = time.time()
        self.outstanding[idx] += 1
        if self.outstanding[idx] == 1:
            self._busy_since[idx] = start
        self.stats.segments += 1
        tokens, finish = 0, "error"
        try:
            if self.servers.kind.in_process:  # emulated engines (engine=sim): the same request, without a socket
                seg = await bounded(
                    self.servers.kind.send_direct(idx, prompt, max_tokens, sampling), self.request_timeout_s
                )
            else:
                path, body = self.servers.kind.generate_request(prompt, max_tokens, sampling)
                if adapter is not None:
                    body.update(self.servers.kind.adapter_fields(adapter))
                if images:
                    body.update(self.servers.kind.image_fields(images))
                body.update(salt_fields(self.servers, version))
                async with self.session.post(url + path, json=body) as resp:
                    text = await resp.text()
                if resp.status >= 500:
                    raise _ServerFailure(f"HTTP {resp.status}: {text[:300]}")
                if resp.status >= 400:
                    raise EngineError(f"{url} rejected the request: HTTP {resp.status}: {text[:500]}")
                seg = self.servers.kind.parse_generate(body := json.loads(text))
                self.prefix_cache.record(idx, body)
            tokens, finish = len(seg.token_ids), seg.finish_reason
            return seg
        except ValueError as e:  # malformed JSON or an unexpected shape
            raise _ServerFailure(f"malformed response: {e}") from e
        except asyncio.TimeoutError as e:
            raise _ServerFailure(f"no response within {self.request_timeout_s:g} s (engine.request_timeout_s)") from e
        except aiohttp.ClientError as e:
            raise _ServerFailure(f"{type(e).__name__}: {e}") from e
        finally:
            end = time.time()
            if adapters is not None:
                adapters.release(adapter)
            self.outstanding[idx] -= 1
            if self.outstanding[idx] == 0 and self._busy_since[idx] is not None:
                self._busy_s[idx] += end - self._busy_since[idx]
                self._busy_since[idx] = None
            if self.on_segment is not None:
                self.on_segment(idx, start, end, tokens, finish)


def _labels(seg: Segment, sent_version: int, adapters: bool) -> Any:
    """The weight version of each token of `seg` (sent at `sent_version`): the engine's own labels; `sent_version`
    where it gave none (unlabelled tokens are filled in by `_append`)."""
    if adapters:
        # The adapter this segment named produced every token of it, whatever the pool activated meanwhile
        # (an adapter sync does not pause: the servers' version spans would say the newest).
        return [sent_version] * len(seg.token_ids)
    # A segment frozen across a sync (on_sync recompute or keep) carries the engine's spans: measured exact on vLLM
    # 0.32 (tokens before the change are the old weights' greedy path, the rest the new weights' continuation of
    # them; tests/integration/test_engine_servers.py).
    return seg.versions if seg.versions is not None else [None] * len(seg.token_ids)


def _append(result: GenerationResult, seg: Segment, take: int, versions: Any, sent_version: int) -> None:
    """The first `take` tokens of `seg` onto `result`, unlabelled tokens labelled `sent_version`."""
    whole = not result.token_ids and seg.finish_reason != "abort" and take == len(seg.token_ids)
    if whole and (isinstance(versions, np.ndarray) or None not in versions):
        # The common case, one segment kept whole and fully labelled: its sequences as they are (no per-token
        # copy; an engine's arrays stay arrays).
        result.token_ids, result.logprobs, result.versions = seg.token_ids, seg.logprobs, versions
        return
    # extend(), not +=: a list += a numpy array would add elementwise.
    result.token_ids.extend(seg.token_ids[:take])
    result.logprobs.extend(seg.logprobs[:take])
    versions = versions[:take]
    # Per-token work is the client's main cost at scale: skip the relabelling pass when no label is missing.
    result.versions.extend(versions if None not in versions else [sent_version if v is None else v for v in versions])
