"""Simulated engine servers (`engine=sim`): the control plane and generation of N engines emulated in this process.

Why in-process and not HTTP: at hundreds of engines and ~10^4 requests per simulated minute, an aiohttp round trip
(JSON of thousands of token ids both ways) would cost more CPU than everything else the rollout path does, and the
benchmark would measure the emulation instead of the framework. So a pool of `SimKind` keeps the real control plane
(pause / resume / reload / set version / reset prefix cache go through the same `ControlPlane` methods and the same
`HttpCall` descriptions as vLLM's; only `SimControl.deliver` hands each to an in-process engine instead of a socket),
and `EngineClient` hands generate requests to `send_direct` instead of posting them, keeping its own balancing,
abort/continue, budget and version logic.

Model of one engine (all times in simulated seconds; wall seconds = simulated / engine.sim.time_scale):
- A request first prefills its prompt (prompt tokens / prefill_tokens_per_s), then joins the decode batch.
- The decode batch advances one token per sequence per step; a step takes decode_step_s + decode_step_per_seq_s * B
  for B sequences (memory-bound decode slows as the batch grows). At most max_seqs decode at once; more wait.
- A sample's total response length L is drawn from a log-normal (length_median, length_sigma). A continuation that
  already holds k generated tokens draws L from the same distribution conditioned on L > k, so aborting and
  continuing a sample does not change the length distribution. Generation stops at L ('stop', the last token a stop
  id) or at the request's budget ('length').
- pause(abort) returns every running request with its tokens so far (finish 'abort'); pause(keep) freezes them;
  requests arriving while paused wait for the resume. Pause, resume and weight reload take their own latencies.
- Token ids are engine.sim.token_id repeated (the stop id last), log-probs a constant; every token is labelled with
  the version the engine held when it was produced. The id must not occur in prompts: a continuation's generated
  tokens are found as the trailing run of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import random
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from fully_async.engines.base import EngineKind
from fully_async.engines.control import ControlPlane
from fully_async.engines.errors import EngineError
from fully_async.engines.types import HttpCall, PauseMode, Sampling, Segment
from fully_async.engines.vllm import VLLMControlCalls

LOGPROB = -0.5
"""Behaviour log-prob the sim reports for every token."""


class LengthModel:
    """Log-normal response length, with draws conditioned on 'longer than k' for continuations."""

    def __init__(self, median: float, sigma: float, rng: random.Random) -> None:
        self.median, self.sigma, self.rng = median, sigma, rng
        self._z = NormalDist()

    def cdf(self, k: float) -> float:
        if self.sigma == 0:
            return 0.0 if k < self.median else 1.0
        if k <= 0:
            return 0.0
        return self._z.cdf((math.log(k / self.median)) / self.sigma)

    def draw(self, longer_than: int = 0) -> int:
        """A total length L >= 1 with L > longer_than."""
        if self.sigma == 0:
            return max(int(round(self.median)), longer_than + 1, 1)
        lo = self.cdf(longer_than)
        u = lo + (1.0 - lo) * self.rng.random()
        u = min(max(u, 1e-12), 1 - 1e-12)
        length = int(self.median * math.exp(self.sigma * self._z.inv_cdf(u)))
        return max(length, longer_than + 1, 1)


class _Request:
    __slots__ = ("done", "seq", "start_p", "finish_p", "tokens", "stop", "spans", "active")

    def __init__(self, seq: int, tokens: int, stop: bool) -> None:
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.seq = seq
        self.tokens = tokens
        """Tokens this segment will produce if nothing interrupts it."""
        self.stop = stop
        self.start_p = 0.0
        self.finish_p = 0.0
        self.spans: list[tuple[float, int]] = []
        """(progress, version) at each version change while this request was decoding."""
        self.active = False


class SimEngine:
    """One emulated engine: a processor-sharing decode batch driven by one timer on the event loop."""

    def __init__(self, index: int, sim: Any, rng: random.Random) -> None:
        self.index, self.sim = index, sim
        self.lengths = LengthModel(sim.length_median, sim.length_sigma, rng)
        self.version = 0
        self.paused = False
        self.frozen = False
        self.generated_tokens = 0
        self.reloads: list[str] = []
        self.hung = False
        """An emulated stopped node: control calls get no answer while it is set (SimControl)."""
        self._resumed: asyncio.Event | None = None
        self._progress = 0.0  # tokens each decoding sequence has received so far (the same for all of them)
        self._t = 0.0  # loop time of the last progress update
        self._running: dict[int, _Request] = {}
        self._waiting: list[_Request] = []  # prefilled, waiting for a decode slot (max_seqs)
        self._prefilling: set[_Request] = set()
        self._heap: list[tuple[float, int]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._seq = itertools.count()

    @property
    def resumed(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            if not self.paused:
                self._resumed.set()
        return self._resumed

    # ---- decode-batch bookkeeping --------------------------------------------------------------------------------
    def _step_s(self) -> float:
        """Wall seconds of one decode step at the current batch size."""
        s = self.sim
        return (s.decode_step_s + s.decode_step_per_seq_s * len(self._running)) / s.time_scale

    def _advance(self) -> None:
        now = asyncio.get_running_loop().time()
        if self._running and not self.frozen:
            self._progress += (now - self._t) / self._step_s()
        self._t = now

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._heap and self._heap[0][1] not in self._running:
            heapq.heappop(self._heap)  # entries of requests that left early (aborted)
        if not self._heap or self.frozen:
            return
        delay = max(0.0, (self._heap[0][0] - self._progress) * self._step_s())
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._advance()
        eps = 1e-6
        while self._heap and self._heap[0][0] <= self._progress + eps:
            _, seq = heapq.heappop(self._heap)
            req = self._running.get(seq)
            if req is not None:
                self._finish(req, req.tokens, "stop" if req.stop else "length")
        self._admit_waiting()
        self._arm()

    def _join(self, req: _Request) -> None:
        if len(self._running) >= self.sim.max_seqs:
            self._waiting.append(req)
            return
        self._advance()
        req.active = True
        req.start_p = self._progress
        req.finish_p = self._progress + req.tokens
        req.spans = [(self._progress, self.version)]
        self._running[req.seq] = req
        heapq.heappush(self._heap, (req.finish_p, req.seq))
        self._arm()

    def _admit_waiting(self) -> None:
        while self._waiting and len(self._running) < self.sim.max_seqs:
            self._join(self._waiting.pop(0))

    def _finish(self, req: _Request, produced: int, reason: str) -> None:
        self._running.pop(req.seq, None)
        req.active = False
        if not req.done.done():
            req.done.set_result((produced, reason))

    # ---- the server's endpoints -------------------------------------------------------------------------------------
    async def generate(self, prompt: list[int], max_tokens: int, sampling: Sampling) -> Segment:
        await self.resumed.wait()
        sim = self.sim
        carried = _trailing_run(prompt, sim.token_id)
        total = self.lengths.draw(carried)
        remaining = total - carried
        tokens, stop = (remaining, True) if remaining <= max_tokens else (max_tokens, False)
        req = _Request(next(self._seq), tokens, stop)
        prefill_s = len(prompt) / sim.prefill_tokens_per_s / sim.time_scale
        self._prefilling.add(req)
        try:
            if prefill_s > 0:
                await asyncio.wait({req.done}, timeout=prefill_s)
        finally:
            self._prefilling.discard(req)
        if not req.done.done():
            self._join(req)
        produced, reason = await req.done
        self.generated_tokens += produced
        # Arrays, not lists: a real engine's JSON must become Python lists, but here building and then converting
        # ~10^3-element lists per sample was the largest cost of the rollout path (see Segment).
        ids = np.full(produced, sim.token_id, dtype=np.int32)
        if reason == "stop" and produced and sampling.stop_token_ids:
            ids[-1] = sampling.stop_token_ids[0]
        logprobs = np.full(produced, LOGPROB, dtype=np.float32)
        return Segment(ids, logprobs, reason, self._versions(req, produced))

    def _versions(self, req: _Request, produced: int) -> np.ndarray:
        if len(req.spans) <= 1:
            return np.full(produced, req.spans[0][1] if req.spans else self.version, dtype=np.int32)
        out = np.full(produced, req.spans[-1][1], dtype=np.int32)
        done = 0
        for (_, v), nxt in zip(req.spans, [*req.spans[1:], (req.start_p + produced, None)]):
            upto = min(produced, int(nxt[0] - req.start_p + 1e-6))
            if upto > done:
                out[done:upto] = v
                done = upto
        return out

    def pause(self, mode: PauseMode) -> None:
        self._advance()
        self.paused = True
        self.resumed.clear()
        if mode == "keep":
            self.frozen = True
            self._arm()
            return
        for req in list(self._prefilling) + self._waiting:
            if not req.done.done():
                req.done.set_result((0, "abort"))
        self._waiting.clear()
        for req in list(self._running.values()):
            self._finish(req, min(req.tokens, int(self._progress - req.start_p + 1e-6)), "abort")
        self._heap.clear()
        self._arm()

    def resume(self) -> None:
        self._advance()
        self.paused = self.frozen = False
        self.resumed.set()
        self._arm()

    def set_version(self, version: int) -> None:
        self._advance()
        self.version = version
        for req in self._running.values():
            req.spans.append((self._progress, version))

    @property
    def running(self) -> int:
        return len(self._running) + len(self._waiting) + len(self._prefilling)


def _trailing_run(ids: list[int], token: int) -> int:
    """Length of the run of `token` at the end of `ids`, by binary search (the id never occurs in prompts)."""
    n = len(ids)
    if not n or ids[-1] != token:
        return 0
    lo, hi = 0, n - 1  # ids[hi] == token; find the first index of the run
    while lo < hi:
        mid = (lo + hi) // 2
        if ids[mid] == token:
            hi = mid
        else:
            lo = mid + 1
    return n - lo


class SimKind(VLLMControlCalls, EngineKind):
    """engine.num_servers emulated engines in this process; their pool (`EngineServers(kind, run_dir,
    addresses=kind.urls)`) launches nothing and delivers its control calls through `SimControl`."""

    name = "sim"
    in_process = True
    unverifiable = "engine=sim holds no weights"
    takes_images = True  # accepted and not looked at: the emulation's answers never depend on the prompt's content

    def __init__(self, cfg: Any, model_path: str | Path, device: str | None = None) -> None:
        super().__init__(cfg, model_path, device or "cpu")
        self.control_class = SimControl
        self.urls = [f"sim://engine-{i}" for i in range(cfg.num_servers)]
        """The emulated servers' addresses (what the pool attaches to)."""
        rng = random.Random(cfg.sim.seed)
        self.engines = [SimEngine(i, cfg.sim, random.Random(rng.random())) for i in range(cfg.num_servers)]
        self.by_url = {url: i for i, url in enumerate(self.urls)}

    def restart_in_process(self, idx: int, version: int) -> None:
        old = self.engines[idx]
        self.engines[idx] = SimEngine(idx, self.cfg.sim, old.lengths.rng)
        self.engines[idx].version = version

    async def send_direct(self, idx: int, prompt: list[int], max_tokens: int, sampling: Sampling) -> Segment:
        """What a POST of generate_request() to server `idx` would return, without the socket."""
        return await self.engines[idx].generate(prompt, max_tokens, sampling)

    # ---- adapter hooks (the same endpoint descriptions as vLLM's) ----------------------------------------------------
    def command(self, index: int, port: int, host: str | None = None) -> list[str]:
        raise EngineError("engine=sim launches no server processes")

    def environment(self, index: int) -> dict[str, str]:
        return {}

    def generate_request(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> tuple[str, dict]:
        return "/inference/v1/generate", {"token_ids": prompt_ids, "max_tokens": max_tokens}

    def parse_generate(self, body: Any) -> Segment:
        raise EngineError("engine=sim answers generate requests in process (send_direct)")


class SimControl(ControlPlane):
    """The control plane of a pool of `SimKind`: the same fan-out, deadlines and set-aside as vLLM's (control.py), each call
    delivered to an in-process engine instead of a socket. An engine marked `hung` answers nothing, as a server on a
    stopped node: the deadline sets it aside like a real one."""

    def session(self) -> Any:
        return contextlib.nullcontext()

    async def deliver(self, session: Any, url: str, call: HttpCall) -> Any:
        kind: Any = self.pool.kind  # a SimKind
        engine = kind.engines[kind.by_url[url]]
        while engine.hung:  # a stopped node: no answer until it continues (the caller's bound ends the wait)
            await asyncio.sleep(0.01)
        sim = kind.cfg.sim
        latency = {"/pause": sim.pause_s, "/resume": sim.resume_s, "/collective_rpc": sim.reload_s}.get(call.path, 0.0)
        if latency:
            await asyncio.sleep(latency / sim.time_scale)  # every engine at once: the fan-out runs them together
        if call.path == "/pause":
            engine.pause(call.params["mode"])
        elif call.path == "/resume":
            engine.resume()
        elif call.path == "/is_paused":
            return {"is_paused": engine.paused}
        elif call.path == "/collective_rpc":
            engine.reloads.append(call.json["kwargs"]["weights_path"])
        elif call.path == "/update_weight_version":
            engine.set_version(int(call.json["new_version"]))
        elif call.path == "/reset_prefix_cache":
            return {"success": True}
        elif call.path != kind.liveness_path:
            raise EngineError(f"sim: no emulated endpoint {call.method} {call.path}")
        return None
