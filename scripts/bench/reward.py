"""RewardAgent benchmarks: limiter overhead per request, accuracy of realized RPM / TPM, and how well per-sample
reward delays overlap generation.

    .venv/bin/python scripts/bench/reward.py                 # all three (~2 min on 2 cores)
    .venv/bin/python scripts/bench/reward.py --only overhead # or: accuracy, delay, sim-delay

- overhead: acquire + release of one permit with limits that never bind, in process and through the named Ray
  actor (leases of lease_s), against a bare call; microseconds per request.
- accuracy: one process, 64 concurrent callers of a 20 ms fake call against rpm=1200 and, separately, tpm=60000
  with usage drawn below the estimate (settled after each call); realized rate over the steady part vs the limit.
  The 4-process version against a real server is tests/integration/test_reward_limits_ray.py.
- delay: a rollouter-free pipeline (this branch has no sim engine): `slots` generation slots each take
  uniform[gen_lo, gen_hi] s per sample; a finished sample frees its slot and is scored by the real RewardAgent with
  `fully_async.reward.rule:delayed_score` (asyncio sleep of the sample's delay, then the built-in rule) while the slot
  generates the next one; a group of n samples completes when all n are scored, and at most `max_groups` groups
  are open (the staleness ledger's room). Throughput = samples scored per second, with delays uniform[1, 40] s x
  time_scale vs zero delay. It measures whether inline async scoring hides reward latency behind generation; it
  does not model the trainer, weight syncs or the ledger's version arithmetic.
- sim-delay (not in the default set; minutes): the same experiment through the whole pipeline in simulation mode
  (scripts/bench/pipeline.py: real Rollouter, MessageQueue, ledger, ParamSync and trainer loop; emulated engines
  and trainer on the calibrated 128-GPU profile, fully async eta = 1 with partial rollout), once with the reward
  `fully_async.reward.sim:delayed_score` sleeping uniform[1, 40] simulated seconds per sample and once with no
  delay; prints both throughputs and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from fully_async.config import RewardConfig, RewardLimitsConfig, RewardSourceConfig
from fully_async.reward import RewardAgent
from fully_async.reward.limiter import RateLimiter, limiter_actor


async def overhead(n: int = 20000) -> None:
    limits = RewardLimitsConfig(rpm=1e9, tpm=1e12, max_concurrent=1_000_000, lease_s=0.1, burst_s=0.2)
    rows = []

    async def bare() -> None:
        await asyncio.sleep(0)

    async def run(lim: RateLimiter | None, label: str) -> None:
        start = time.perf_counter()
        for _ in range(n):
            if lim is None:
                await bare()
                continue
            p = await lim.acquire(100)
            await bare()
            lim.release(p, 80)
        per = (time.perf_counter() - start) / n * 1e6
        calls = lim.actor_calls if lim is not None else 0
        if lim is not None:
            lim.shutdown()
        rows.append((label, per, calls))

    await run(None, "no limiter")
    await run(RateLimiter(limits), "in process")
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        await run(RateLimiter(limits, limiter_actor("bench", limits, "bench-reward")), "Ray actor")
    finally:
        ray.shutdown()
    print(f"\n### limiter overhead ({n} sequential requests, limits never binding)\n")
    print("| limiter | us per request | awaited actor calls |\n| --- | --- | --- |")
    for label, per, calls in rows:
        print(f"| {label} | {per:.1f} | {calls} |")


async def accuracy(duration_s: float = 20.0, warmup_s: float = 3.0) -> None:
    print(f"\n### realized rate, one process, 64 callers, {duration_s:g} s (first {warmup_s:g} s excluded)\n")
    print("| limit | configured | realized | error |\n| --- | --- | --- | --- |")
    for kind, limits in (("rpm", RewardLimitsConfig(rpm=1200)), ("tpm", RewardLimitsConfig(tpm=60000))):
        realized = await _realized(kind, limits, duration_s, warmup_s)
        want = limits.rpm if kind == "rpm" else limits.tpm
        print(f"| {kind} | {want:g} | {realized:.0f} | {100 * (realized / want - 1):+.2f}% |")


async def _realized(kind: str, limits: RewardLimitsConfig, duration_s: float, warmup_s: float) -> float:
    lim = RateLimiter(limits)
    stamps: list[tuple[float, float]] = []
    rng = random.Random(0)
    deadline = time.monotonic() + duration_s

    async def caller() -> None:
        while time.monotonic() < deadline:
            p = await lim.acquire(300)  # estimate: prompt + max output
            await asyncio.sleep(0.02)
            used = rng.uniform(150, 300)  # what the API reports, below the estimate
            stamps.append((time.monotonic(), used))
            lim.release(p, used)

    start = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(64)))
    t0, t1 = start + warmup_s, start + duration_s - 0.5
    steady = [(t, u) for t, u in stamps if t0 <= t < t1]
    value = len(steady) if kind == "rpm" else sum(u for _, u in steady)
    return value / (t1 - t0) * 60


async def delay(samples: int, slots: int, n: int, max_groups: int, scale: float, gen: tuple[float, float]) -> None:
    print(f"\n### delayed rewards: {samples} samples, {slots} generation slots, n={n}, {max_groups} open groups, "
          f"generation uniform[{gen[0]:g}, {gen[1]:g}] s, time scale {scale:g}\n")  # fmt: skip
    print("| reward delay | wall s | samples/s | reward s mean | reward s max |\n| --- | --- | --- | --- | --- |")
    results = {}
    for label, lo, hi in (("zero", 0.0, 0.0), ("uniform[1, 40] s", 1.0, 40.0)):
        wall, reward_s = await _pipeline(samples, slots, n, max_groups, gen, (lo * scale, hi * scale))
        results[label] = samples / wall
        print(f"| {label} x {scale:g} | {wall:.1f} | {samples / wall:.1f} | {statistics.mean(reward_s):.2f} | "
              f"{max(reward_s):.2f} |")  # fmt: skip
    ratio = results["uniform[1, 40] s"] / results["zero"]
    print(f"\nthroughput ratio (delayed / zero delay): {ratio:.3f}")


async def _pipeline(samples, slots, n, max_groups, gen, delay_range) -> tuple[float, list[float]]:
    source = RewardSourceConfig(kind="fully_async.reward.rule:delayed_score", timeout_s=3600)
    agent = RewardAgent(RewardConfig([source], num_workers=1))
    rng = random.Random(1)
    slot, room = asyncio.Semaphore(slots), asyncio.Semaphore(max_groups)
    reward_s: list[float] = []

    async def sample() -> None:
        async with slot:  # generating; the slot is free again before the reward is awaited, as in the Rollouter
            await asyncio.sleep(rng.uniform(*gen))
        meta = {"data_source": "fully_async/synthetic", "ground_truth": "7",
                "extra_info": {"reward_delay_s": rng.uniform(*delay_range)}}  # fmt: skip
        r = await agent.score("7", meta)
        reward_s.append(r.info["reward_s"])

    async def group() -> None:
        try:
            await asyncio.gather(*(sample() for _ in range(n)))
        finally:
            room.release()

    start = time.monotonic()
    tasks = []
    for _ in range(samples // n):
        await room.acquire()
        tasks.append(asyncio.create_task(group()))
    await asyncio.gather(*tasks)
    wall = time.monotonic() - start
    await agent.aclose()
    return wall, reward_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["overhead", "accuracy", "delay", "sim-delay"])
    ap.add_argument("--versions", type=int, default=3, help="sim-delay: weight versions per run")
    ap.add_argument("--time-scale", type=float, default=5.0, help="sim-delay: simulated seconds per wall second")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-groups", type=int, default=256)
    ap.add_argument("--scale", type=float, default=0.05, help="time scale of the [1, 40] s delays")
    ap.add_argument("--gen", type=float, nargs=2, default=(0.25, 0.75), help="generation seconds per sample")
    args = ap.parse_args()
    if args.only in (None, "overhead"):
        asyncio.run(overhead())
    if args.only in (None, "accuracy"):
        asyncio.run(accuracy())
    if args.only in (None, "delay"):
        asyncio.run(delay(args.samples, args.slots, args.n, args.max_groups, args.scale, tuple(args.gen)))
    if args.only == "sim-delay":
        sim_delay(args.versions, args.time_scale)


def sim_delay(versions: int, time_scale: float) -> None:
    """Two runs of scripts/bench/pipeline.py (fully async, eta 1, partial rollout) that differ only in the reward's
    delay; each is its own process, so each starts its own local Ray with its own environment."""
    import importlib.util
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    from fully_async.reward.sim import DELAY_ENV, SCALE_ENV

    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("fully_async_bench_pipeline", here / "pipeline.py")
    pipeline = importlib.util.module_from_spec(spec)  # the sibling script, by path (scripts/ is no package)
    spec.loader.exec_module(pipeline)
    out = Path(tempfile.mkdtemp(prefix="fully_async-reward-delay-"))
    source = "reward.sources=[{kind: 'fully_async.reward.sim:delayed_score', timeout_s: 120}]"
    rates = {}
    for name, delay_s in (("no delay", ""), ("uniform[1, 40] s", "1,40")):
        run_dir = out / ("delay" if delay_s else "none")
        env = {**os.environ, DELAY_ENV: delay_s, SCALE_ENV: str(time_scale)}
        cmd = [sys.executable, str(here / "pipeline.py"), "--versions", str(versions), "--time-scale",
               str(time_scale), "--schedules", "async_eta1_partial", "--out", str(run_dir), source]  # fmt: skip
        print(f"sim-delay: {name}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        summary = json.loads((run_dir / "async_eta1_partial" / "bench.json").read_text())
        s = pipeline.evaluate(run_dir / "async_eta1_partial")
        rates[name] = (s["samples_per_s"], s["samples_per_s_steady"])
        print(f"sim-delay: {name}: {s['samples']} samples, {s['samples_per_s']:.1f} samples/s (simulated), "
              f"trainer idle {s['trainer_idle']:.2f}, {summary['wall_s']:.0f} wall s", flush=True)  # fmt: skip
    (none, none_steady), (late, late_steady) = rates["no delay"], rates["uniform[1, 40] s"]
    print(f"\n| reward delay | samples/s, whole run | samples/s after the first version |\n|---|---|---|\n"
          f"| none | {none:.1f} | {none_steady:.1f} |\n| uniform[1, 40] s | {late:.1f} | {late_steady:.1f} |\n"
          f"\nthroughput ratio (delayed / none): {late / none:.3f} whole run, {late_steady / none_steady:.3f} after "
          "the first version (filling the pipeline waits for the first batch's slowest rewards)")  # fmt: skip


if __name__ == "__main__":
    main()
