"""An OpenAI-compatible chat-completions server on 127.0.0.1 for reward tests: a judge API at the edge of the system.

It enforces its own per-model limits the way hosted APIs do (requests and tokens over a sliding window, and
concurrent requests) and answers 429 with Retry-After past them; it reports token usage; and it misbehaves on
request. Tokens are UTF-8 bytes (the tiny model's tokenizer counts the same way).

The reply is steered by directives in the prompt text, so a test states what it expects next to what it sends:
`[[score=0.7]]` (reply "Score: 0.7"; default 0.5), `[[tokens=N]]` (completion length, capped by max_tokens),
`[[sleep=S]]`, `[[status=500]]`, `[[malformed]]` (200 with a body that is not JSON), `[[noscore]]`,
`[[fail_first=N]]` (the first N requests carrying this prompt answer 503).

`Worker` is what each Ray worker process of the limiter test runs: a RewardAgent scoring as fast as its limits allow.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

DIRECTIVE = re.compile(r"\[\[(\w+)(?:=([^\]]*))?\]\]")


@dataclass
class ModelLimits:
    rpm: float = 0.0
    tpm: float = 0.0
    max_concurrent: int = 0
    window_s: float = 10.0
    """Requests and tokens are counted over this sliding window against rpm * window_s / 60 (and tpm likewise)."""


@dataclass
class Record:
    t: float
    model: str
    status: int
    tokens: int = 0


@dataclass
class JudgeServer:
    limits: dict[str, ModelLimits] = field(default_factory=dict)
    api_key: str | None = None
    latency_s: float = 0.02
    records: list[Record] = field(default_factory=list)
    in_flight: collections.Counter = field(default_factory=collections.Counter)
    max_in_flight: collections.Counter = field(default_factory=collections.Counter)
    url: str = ""

    def __post_init__(self) -> None:
        self._window: dict[str, collections.deque[tuple[float, int]]] = collections.defaultdict(collections.deque)
        self._seen: collections.Counter = collections.Counter()
        self._runner: web.AppRunner | None = None

    async def start(self) -> JudgeServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def count(self, model: str | None = None, status: int | None = None, since: float = 0.0, until: float = 1e18):
        return [
            r
            for r in self.records
            if (model is None or r.model == model) and (status is None or r.status == status) and since <= r.t < until
        ]

    def _admit(self, model: str, tokens: int, now: float) -> float | None:
        """None when the request fits the model's limits (and is counted), else seconds until it would."""
        lim = self.limits.get(model)
        if lim is None:
            return None
        if lim.max_concurrent and self.in_flight[model] >= lim.max_concurrent:
            return 0.2
        window = self._window[model]
        while window and window[0][0] <= now - lim.window_s:
            window.popleft()
        waits = []
        if lim.rpm and len(window) + 1 > lim.rpm * lim.window_s / 60:
            waits.append(window[0][0] + lim.window_s - now)
        if lim.tpm:
            budget, used = lim.tpm * lim.window_s / 60, sum(t for _, t in window)
            if used + tokens > budget:
                freed, wait = 0, 0.0
                for t, n in window:  # how long until enough tokens leave the window
                    freed += n
                    wait = t + lim.window_s - now
                    if used - freed + tokens <= budget:
                        break
                waits.append(wait)
        if waits:
            return max(0.01, max(waits))
        window.append((now, tokens))
        return None

    async def _chat(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            # Echoes what it was sent, as some servers do: the client must not repeat it in its own errors.
            return web.json_response(
                {"error": {"message": f"bad key in {request.headers.get('Authorization')!r}"}}, status=401
            )
        body = await request.json()
        model = body.get("model", "")
        prompt = "".join(m.get("content", "") for m in body.get("messages", []))
        d = {k: v for k, v in DIRECTIVE.findall(prompt)}
        prompt_tokens = len(prompt.encode())
        completion = self._completion(d, int(body.get("max_tokens") or 64))
        tokens = prompt_tokens + len(completion.encode())
        if "status" in d:
            self.records.append(Record(now, model, int(d["status"])))
            return web.json_response({"error": {"message": "scripted failure"}}, status=int(d["status"]))
        if "fail_first" in d:
            self._seen[prompt] += 1
            if self._seen[prompt] <= int(d["fail_first"]):
                self.records.append(Record(now, model, 503))
                return web.json_response({"error": {"message": "overloaded (scripted)"}}, status=503)
        wait = self._admit(model, tokens, now)
        if wait is not None:
            self.records.append(Record(now, model, 429))
            return web.json_response(
                {"error": {"message": "rate limit", "type": "rate_limit"}},
                status=429,
                headers={"Retry-After": f"{wait:.3f}"},
            )
        self.records.append(Record(now, model, 200, tokens))
        self.in_flight[model] += 1
        self.max_in_flight[model] = max(self.max_in_flight[model], self.in_flight[model])
        try:
            await asyncio.sleep(float(d.get("sleep", self.latency_s)))
        finally:
            self.in_flight[model] -= 1
        if "malformed" in d:
            return web.Response(status=200, text='{"id": "x", "choices": [', content_type="application/json")
        return web.json_response(
            {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": completion}}
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(completion.encode()),
                    "total_tokens": tokens,
                },
            }
        )

    @staticmethod
    def _completion(d: dict[str, str], max_tokens: int) -> str:
        text = "The answer holds." if "noscore" in d else f"Score: {d.get('score', '0.5')}"
        want = int(d.get("tokens", len(text)))
        text = (text + " " + "x" * max(0, want - len(text) - 1)) if want > len(text) else text
        return text.encode()[:max_tokens].decode(errors="ignore")


class Worker:
    """One scoring process of the limiter test: a RewardAgent per reward config (a RewardConfig as a dict), each
    scoring `texts` with up to `concurrency` calls in flight, all at once."""

    def __init__(self, reward_cfgs: list[dict[str, Any]], tokenizer_path: str | None = None) -> None:
        from fully_async.config import RewardConfig, from_dict
        from fully_async.reward import RewardAgent

        self.agents = []
        for raw in reward_cfgs:
            cfg = from_dict(RewardConfig, raw, "reward")
            cfg.validate_section("reward.")
            self.agents.append(RewardAgent(cfg, tokenizer_path))

    async def run(self, texts: list[str], duration_s: float | None, concurrency: int) -> list[dict[str, Any]]:
        """Score `texts` in a loop for duration_s (once each when None). Per agent: scores, failures, stats."""
        for a in self.agents:
            await a.check_sources([])
        return list(await asyncio.gather(*(self._drive(a, texts, duration_s, concurrency) for a in self.agents)))

    @staticmethod
    async def _drive(agent, texts: list[str], duration_s: float | None, concurrency: int) -> dict[str, Any]:
        results: list[tuple[float, bool]] = []
        deadline = None if duration_s is None else time.monotonic() + duration_s
        pending = collections.deque(texts)
        meta = {"data_source": "judge_test", "ground_truth": "7", "extra_info": {}, "question": "What is 3+4?"}

        async def lane(offset: int) -> None:
            i = offset
            while True:
                if deadline is None:
                    if not pending:
                        return
                    text = pending.popleft()
                else:
                    if time.monotonic() >= deadline:
                        return
                    text, i = texts[i % len(texts)], i + 1
                r = await agent.score(text, meta)
                results.append((r.score, bool(r.info.get("reward_failed"))))

        lanes = [asyncio.ensure_future(lane(k)) for k in range(concurrency)]
        if deadline is None:
            await asyncio.gather(*lanes)
        else:  # at the deadline the calls still waiting for their limiter are abandoned, not drained for minutes
            await asyncio.wait(lanes, timeout=max(0.0, deadline - time.monotonic()))
            for t in lanes:
                t.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)
        return {"scores": [s for s, _ in results], "failed": sum(f for _, f in results), "stats": agent.stats()}

    async def close(self) -> None:
        for a in self.agents:
            await a.aclose()


@dataclass
class RewardModelServer:
    """vLLM's /classify and /pooling on 127.0.0.1 for a two-label reward model: probs = [1 - x, x] with
    x = len(response) / 100 (capped at 1), after `latency_s`. Counts the requests it served."""

    latency_s: float = 0.0
    served: int = 0
    url: str = ""

    async def start(self) -> RewardModelServer:
        app = web.Application()
        app.router.add_post("/classify", self._classify)
        app.router.add_post("/pooling", self._pooling)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _x(self, request: web.Request) -> tuple[float, int]:
        body = await request.json()
        response = body["messages"][-1]["content"]
        await asyncio.sleep(self.latency_s)
        self.served += 1
        return min(1.0, len(response) / 100), sum(len(m["content"]) for m in body["messages"])

    async def _classify(self, request: web.Request) -> web.Response:
        x, tokens = await self._x(request)
        data = [{"index": 0, "label": "good", "probs": [1 - x, x], "num_classes": 2}]
        return web.json_response({"object": "list", "data": data, "usage": {"total_tokens": tokens}})

    async def _pooling(self, request: web.Request) -> web.Response:
        x, tokens = await self._x(request)
        data = [{"index": 0, "object": "pooling", "data": [[0.0, 0.0], [1 - x, x]]}]
        return web.json_response({"object": "list", "data": data, "usage": {"total_tokens": tokens}})
