"""Cluster-wide reward limits: 4 Ray worker processes score against one rate-limited judge server for 30+ s.

Two judge sources run side by side, one bound by its RPM limit and one by its TPM limit (set below the server's).
The ceiling is proven by counts, not by a clock: the server enforces its own limits 25% above ours over every 10 s
window (what 4 processes' leases of 0.5 s may add at most) and answers 429 past them, and no request may meet a 429;
nor may more requests be in flight at once than configured across all processes. One generous bound remains, on
the floor: the realized rate over the steady part is at least 80% of the limit (a limiter that starves its callers
fails it; a busy machine makes the rate lower, never higher)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import pytest

from fully_async.config import JudgeConfig, RewardConfig, RewardLimitsConfig, RewardSourceConfig, TinyModelConfig
from fully_async.models import build_tiny_model
from tests.reward_server import JudgeServer, ModelLimits, Worker

pytestmark = pytest.mark.slow
SECRET = "sk-limits-test-key"
RPM, TPM, CONCURRENT = 600.0, 30000.0, 8
DURATION_S, WARMUP_S = 32.0, 6.0


def reward_cfg(server: JudgeServer, name: str, model: str, limits: RewardLimitsConfig, namespace: str) -> dict:
    # A short prompt: many small requests, so one request more or less in the window is well under 1% of it.
    judge = JudgeConfig(base_url=server.url, model=model, api_key_env="LIMITS_TEST_KEY", max_tokens=64,
                        prompt_template="{question}|{response}|{reference}")  # fmt: skip
    src = RewardSourceConfig(kind="judge", name=name, timeout_s=10.0, retries=2, judge=judge, limits=limits)
    return dataclasses.asdict(RewardConfig([src], limiter_namespace=namespace))


async def test_rpm_tpm_and_concurrency_hold_across_four_processes(ray_local):
    ray = ray_local
    server = await JudgeServer(api_key=SECRET, latency_s=0.05).start()
    # The server's own limits sit 25% above ours, over a 10 s window: a client that overshoots meets a 429.
    server.limits = {
        "rpm-model": ModelLimits(rpm=RPM * 1.25, tpm=1e9, max_concurrent=CONCURRENT + 4, window_s=10.0),
        "tpm-model": ModelLimits(rpm=1e6, tpm=TPM * 1.25, window_s=10.0),
    }
    ns = f"limits-test-{uuid.uuid4().hex[:8]}"
    cfgs = [
        reward_cfg(server, "by_rpm", "rpm-model", RewardLimitsConfig(rpm=RPM, max_concurrent=CONCURRENT, lease_s=0.5), ns),
        reward_cfg(server, "by_tpm", "tpm-model", RewardLimitsConfig(tpm=TPM, lease_s=0.5), ns),
    ]  # fmt: skip
    # Completions of 8..60 tokens against an estimate of prompt + 64: settlement refunds the difference.
    texts = [f"answer {i} [[score=1]] [[tokens={8 + (i * 13) % 53}]]" for i in range(40)]
    tokenizer = str(build_tiny_model(TinyModelConfig()))
    remote = ray.remote(Worker).options(num_cpus=0, runtime_env={"env_vars": {"LIMITS_TEST_KEY": SECRET}})
    started = time.monotonic()
    workers = [remote.remote(cfgs, tokenizer) for _ in range(4)]
    try:
        runs = await asyncio.gather(*(w.run.remote(texts, DURATION_S, 24) for w in workers))
    finally:
        await asyncio.gather(*(w.close.remote() for w in workers), return_exceptions=True)
        for w in workers:
            ray.kill(w)
        await server.stop()

    first = min(r.t for r in server.records)
    print(f"worker start-up {first - started:.1f} s, run {server.records[-1].t - first:.1f} s")
    assert not server.count(status=429), f"{len(server.count(status=429))} requests met the server's limits"
    assert sum(r["failed"] for run in runs for r in run) == 0
    assert server.max_in_flight["rpm-model"] <= CONCURRENT
    for model, index in (("rpm-model", 0), ("tpm-model", 1)):
        ok = server.count(model=model, status=200)
        scored = sum(len(run[index]["scores"]) for run in runs)
        # Every answered request was one scored sample, except those cut off by the deadline while at the server.
        assert scored <= len(ok) <= scored + 4 * 24
        # Steady part: the 4 processes start seconds apart (imports on a busy machine), and each stops at its own
        # deadline; in between every process is waiting on the limiter, so the limiter alone sets the rate.
        t0, t1 = ok[0].t + WARMUP_S, ok[-1].t - 1.0
        assert t1 - t0 >= 20, "the steady part of the run is too short to measure"
        steady = [r for r in ok if t0 <= r.t < t1]
        rpm = len(steady) / (t1 - t0) * 60
        tpm = sum(r.tokens for r in steady) / (t1 - t0) * 60
        stats = [run[index]["stats"][f"by_{model[:3]}"] for run in runs]
        calls, rate_calls = (sum(s[k] for s in stats) for k in ("limiter_actor_calls", "limiter_rate_calls"))
        print(f"{model}: realized rpm {rpm:.0f} tpm {tpm:.0f}; {scored} requests, {calls} limiter actor calls "
              f"({rate_calls} for rate permits)")  # fmt: skip
        realized, limit = (rpm, RPM) if model == "rpm-model" else (tpm, TPM)
        assert realized >= 0.8 * limit, f"{model}: {realized:.0f} of {limit:.0f} per minute"
        # Rate permits come in leases of lease_s of traffic. A concurrency slot costs at most one awaited call per
        # request (its release is sent without waiting), fewer when one lease serves several calls.
        assert rate_calls < 0.3 * scored, "rate permits are asked per request, not per lease"
        assert calls < 1.3 * scored
