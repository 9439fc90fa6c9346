"""What the gateway adds to one model call, side by side with the direct call it wraps (issue 49).

    .venv/bin/python scripts/bench/gateway_overhead.py --calls 200 --engine-ms 0

Three ways to make the same model call, on one engine stub that answers `--tokens` tokens after `--engine-ms`
milliseconds (0: the gateway's own cost alone, the engine's time is the same in all three):
- `engine`: EngineClient.generate's stand-in itself (the floor);
- `direct`: the rollout-function loop's ChatClient.chat (template delta, exact-token bookkeeping), in process;
- `gateway`: an `openai`-SDK program in another process calling /v1/chat/completions on its session (HTTP, JSON,
  the SDK), which makes the same ChatClient.chat call underneath.
Each conversation grows for --turns calls (user turn, model turn, ...) and then starts afresh, as an agent's does
(the ChatClient closes the row and starts a new one, in both ways).
Prints the median and p90 milliseconds per call of each and the gateway's overhead (gateway - direct medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fully_async.agents.rollout_fn import ChatClient, RolloutFnAgentLoop
from fully_async.config import MultiTurnConfig
from fully_async.engines import Sampling
from fully_async.engines.types import GenerationResult
from fully_async.gateway.server import GatewayServer
from fully_async.models.tiny import build_tokenizer

AGENT = """
import json, os, sys, time
from openai import OpenAI
client, calls, turns = OpenAI(max_retries=0), int(sys.argv[1]), int(sys.argv[2])
out, messages = [], []
for k in range(calls):
    if k % turns == 0:
        messages = [{"role": "user", "content": "go"}]
    t0 = time.perf_counter()
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    out.append(time.perf_counter() - t0)
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "more"}]
print(json.dumps(out))
"""


class StubEngine:
    """Answers `tokens` tokens (the end-of-turn id last) after `delay_s`."""

    def __init__(self, tokens: int, end: int, delay_s: float) -> None:
        self.ids, self.delay_s = [97 + i % 20 for i in range(tokens - 1)] + [end], delay_s

    async def generate(self, prompt_ids, max_tokens, sampling=None, continue_on_abort=True, images=None):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        ids = self.ids[:max_tokens]
        return GenerationResult(list(ids), [-0.5] * len(ids), [0] * len(ids), "stop")


def summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))], "n": len(ms)}


async def direct(loop: RolloutFnAgentLoop, engine: StubEngine, calls: int, turns: int) -> list[float]:
    out: list[float] = []
    chat = ChatClient(loop, engine)
    for k in range(calls):
        if k % turns == 0:  # a fresh conversation: the ChatClient closes the row and starts a new one
            messages = [{"role": "user", "content": "go"}]
        t0 = time.perf_counter()
        reply = await chat.chat(messages)
        out.append(time.perf_counter() - t0)
        messages = [*messages, reply, {"role": "user", "content": "more"}]
    return out


async def through_gateway(loop, engine, tok, calls: int, turns: int) -> list[float]:
    server = await GatewayServer(tok).start()
    try:
        session = server.open(ChatClient(loop, engine))
        env = {**os.environ, "OPENAI_BASE_URL": session.base_url, "OPENAI_API_KEY": session.key}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", AGENT, str(calls), str(turns), env=env,
                                                    stdout=asyncio.subprocess.PIPE)  # fmt: skip
        out, _ = await proc.communicate()
        return json.loads(out.decode())
    finally:
        await server.stop()


async def main(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    tok_dir = Path(tempfile.mkdtemp())
    build_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)

    async def unused(*a, **k):
        return None

    loop = RolloutFnAgentLoop(tok, Sampling(), 4096, True, MultiTurnConfig(max_turns=args.calls), unused)
    engine = StubEngine(args.tokens, tok.convert_tokens_to_ids("<|im_end|>"), args.engine_ms / 1000)
    floor = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        await engine.generate([1, 2, 3], args.tokens)
        floor.append(time.perf_counter() - t0)
    results = {"engine": summary(floor), "direct": summary(await direct(loop, engine, args.calls, args.turns)),
               "gateway": summary(await through_gateway(loop, engine, tok, args.calls, args.turns))}  # fmt: skip
    results["overhead_median_ms"] = results["gateway"]["median_ms"] - results["direct"]["median_ms"]
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--turns", type=int, default=4, help="calls per conversation before it starts afresh")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per model turn")
    parser.add_argument("--engine-ms", type=float, default=0.0, help="the engine stub's milliseconds per call")
    res = asyncio.run(main(parser.parse_args()))
    print(json.dumps(res, indent=1))
    print("| path | median ms | p90 ms |\n|---|---|---|")
    for k in ("engine", "direct", "gateway"):
        print(f"| {k} | {res[k]['median_ms']:.2f} | {res[k]['p90_ms']:.2f} |")
    print(f"gateway overhead per call (median): {res['overhead_median_ms']:.2f} ms")
