"""A distillation teacher on 127.0.0.1 for tests: a server at the edge of the system, answering prompt log-probs in
vLLM's two shapes (the token-in `/inference/v1/generate` and the OpenAI-compatible `/v1/completions`), run as its
own process so a test can SIGKILL it mid-run.

The log-prob of the token at position i of the request's ids is `logprob(ids[i], i)` below, so a test knows what a
correct answer is. `--no-prompt-logprobs` makes it answer without them (a server that cannot return them);
`--delay LO,HI --time-scale S` makes each answer wait uniform[LO, HI] / S seconds (a slow teacher, for
scripts/bench/distill.py).

    python -m tests.teacher_server PORT [--no-prompt-logprobs] [--delay LO,HI --time-scale S]   # prints "ready"
"""

from __future__ import annotations

import asyncio
import random
import sys

from aiohttp import web


def logprob(token: int, position: int) -> float:
    return -((token * 7 + position) % 50) / 10.0


def prompt_logprobs(ids: list[int]) -> list:
    return [None] + [{str(t): {"logprob": logprob(t, i), "rank": 1}} for i, t in enumerate(ids) if i > 0]


def app(with_logprobs: bool = True, delay: tuple[float, float] = (0.0, 0.0)) -> web.Application:
    load = {"now": 0, "peak": 0}

    async def wait() -> None:
        load["now"] += 1
        load["peak"] = max(load["peak"], load["now"])
        try:
            if delay[1] > 0:
                await asyncio.sleep(random.uniform(*delay))
        finally:
            load["now"] -= 1

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(load)

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        await wait()
        ids = body["token_ids"]
        wanted = with_logprobs and (body.get("sampling_params") or {}).get("prompt_logprobs") is not None
        out = {"choices": [{"token_ids": [0], "finish_reason": "length"}],
               "prompt_logprobs": prompt_logprobs(ids) if wanted else None,
               "usage": {"prompt_tokens": len(ids)}}  # fmt: skip
        return web.json_response(out)

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        await wait()
        ids = body["prompt"]
        choice = {"text": "x", "finish_reason": "length"}
        if with_logprobs and body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = prompt_logprobs(ids)
        return web.json_response({"choices": [choice], "usage": {"prompt_tokens": len(ids)}})

    application = web.Application()
    application.router.add_post("/inference/v1/generate", generate)
    application.router.add_post("/v1/completions", completions)
    application.router.add_get("/stats", stats)  # requests in flight now and at most (a test's view of concurrency)
    return application


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    port = int(sys.argv[1])
    scale = float(_option("--time-scale", "1"))
    lo, hi = (float(x) / scale for x in _option("--delay", "0,0").split(","))

    async def serve() -> None:
        runner = web.AppRunner(app("--no-prompt-logprobs" not in sys.argv, (lo, hi)))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
