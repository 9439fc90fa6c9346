"""Benchmark of the verl training backend on CPU: update time per 1k tokens at world size 1 and 2 next to a plain
single-process torch loop doing the same math, and weight-export time against model size.

    .venv/bin/python scripts/bench/trainer.py                       # defaults used for docs/benchmarks.md
    .venv/bin/python scripts/bench/trainer.py --hidden 256 --layers 4 --steps 5 --threads 2 --export-hidden 128 256

"Same math" per step: a no-grad forward for the proximal log-probs, truncated token importance weights, one
forward/backward of the clipped PPO loss (token-mean), grad clipping and an AdamW step, all in float32. The
difference between the two is what our driver plus verl's engine add (Ray dispatch, no-padding layout,
token-budget micro-batching, FSDP2 wrapping). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np
import torch

from fully_async.config import AlgorithmConfig, TinyModelConfig, TrainerConfig
from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup, flatten

PHASES = ("timing_s/log_probs", "timing_s/train")
"""Update phases timed in both trainers (the backend reports them in its update metrics)."""


def make_batch(num_groups: int, n: int, prompt_len: int, response_len: int, seed: int = 0) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        ref = PromptRef(0, g)
        trajs = [
            Trajectory(
                prompt=ref,
                sample_index=s,
                prompt_ids=rng.integers(0, 256, prompt_len),
                response_ids=rng.integers(0, 256, response_len),
                behaviour_logprobs=np.full(response_len, -5.5) + 0.05 * rng.standard_normal(response_len),
                token_versions=np.zeros(response_len),
                reward=float(rng.integers(0, 2)),
            )
            for s in range(n)
        ]
        groups.append(TrajectoryGroup(ref, trajs))
    return groups


def timed(fn, steps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def plain_torch_step_fn(model_dir: Path, groups, temperature: float):
    """The same update in one process with plain torch + transformers (padded batch)."""
    from transformers import AutoModelForCausalLM

    from fully_async.training import batch as B

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    b = B.assemble(groups)
    adv = B.compute_advantages(b, "grpo")
    ids = torch.cat([b.prompts, b.responses], 1)
    p = b.prompts.shape[1]
    mask = b.response_mask.float()

    def log_probs():
        logits = model(input_ids=ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
        logits = logits[:, p - 1 : -1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, b.responses[..., None])[..., 0]

    def step() -> dict[str, float]:
        """One update; returns its phase times under the keys the backend's update metrics use."""
        t0 = time.perf_counter()
        with torch.no_grad():
            prox = log_probs()
        t1 = time.perf_counter()
        w = torch.clamp(torch.exp(prox - b.behaviour_logprobs), max=2.0)
        lp = log_probs()
        ratio = torch.exp(lp - prox)
        loss_tok = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28)) * w
        loss = (loss_tok * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"timing_s/log_probs": t1 - t0, "timing_s/train": time.perf_counter() - t1}

    return step


def bench_update(args, model_dir: Path) -> list[tuple[str, float, float]]:
    """Times one update of each trainer in turn, round after round, so that load from elsewhere on the machine
    falls on all of them alike; reports the median per trainer."""
    import ray

    from fully_async.training import build_backend

    groups = make_batch(args.groups, args.n, args.prompt_len, args.response_len)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in flatten(groups))
    steps = {"plain torch, 1 process": plain_torch_step_fn(model_dir, groups, 1.0)}
    os.environ.setdefault("RAY_worker_niceness", "0")  # as the runner: Ray workers compete at the driver's priority
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    backends = []
    try:
        for ws in args.world_sizes:
            for units in args.fsdp_units:
                trainer = TrainerConfig(
                    n_gpus_per_node=ws,
                    max_token_len_per_gpu=args.token_budget,
                    total_steps=1000,
                    cpu_threads_per_rank=args.threads,
                    fsdp_units=units,
                )
                backends.append(build_backend(trainer, AlgorithmConfig(), model_dir, device="cpu"))
                name = f"verl backend, world size {ws}" + (f", fsdp_units={units}" if len(args.fsdp_units) > 1 else "")
                steps[name] = lambda be=backends[-1]: be.update(groups)
        times: dict[str, list[float]] = {name: [] for name in steps}
        phases: dict[str, list[dict[str, float]]] = {name: [] for name in steps}
        for r in range(2 + args.steps):  # two warm-up rounds
            for name, fn in steps.items():
                t = time.perf_counter()
                metrics = fn()
                if r >= 2:
                    times[name].append(time.perf_counter() - t)
                    phases[name].append(metrics)
    finally:
        for be in backends:
            be.shutdown()
    plain = statistics.median(times["plain torch, 1 process"])
    print(
        f"\nUpdate ({len(flatten(groups))} trajectories, {tokens} tokens, median of {args.steps} interleaved rounds)\n"
    )
    print("| trainer | s / update | s / 1k tokens | vs plain torch |")
    print("| --- | --- | --- | --- |")
    rows = []
    for name, ts in times.items():
        t = statistics.median(ts)
        rows.append((name, t, t / tokens * 1000))
        print(f"| {name} | {t:.3f} | {t / tokens * 1000:.3f} | {(t / plain - 1) * 100:+.0f}% |")
    print("\nPhases (median s): the pi_prox forward, then forward + backward + optimizer step\n")
    print("| trainer | pi_prox forward | vs plain torch | train | vs plain torch |")
    print("| --- | --- | --- | --- | --- |")
    med = {n: {k: statistics.median(m[k] for m in ms) for k in PHASES} for n, ms in phases.items()}
    base = med["plain torch, 1 process"]
    for name, m in med.items():
        cells = " | ".join(f"{m[k]:.3f} | {(m[k] / base[k] - 1) * 100:+.0f}%" for k in PHASES)
        print(f"| {name} | {cells} |")
    return rows


def bench_export(args, cache: Path) -> None:
    from fully_async.models import build_tiny_model
    from fully_async.training import build_backend

    print("\nWeight export (world size 1, float32 safetensors to local disk, median of 3)\n")
    print("| hidden x layers | parameters | MB written | export s | MB/s |")
    print("| --- | --- | --- | --- | --- |")
    for hidden in args.export_hidden:
        cfg = TinyModelConfig(hidden_size=hidden, num_layers=args.layers, intermediate_size=4 * hidden)
        model_dir = build_tiny_model(cfg, cache)
        be = build_backend(
            TrainerConfig(max_token_len_per_gpu=args.token_budget), AlgorithmConfig(), model_dir, device="cpu"
        )
        try:
            with tempfile.TemporaryDirectory() as out:
                t = timed(lambda be=be, out=out: be.export_weights(out), 3)
                size = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
        finally:
            be.shutdown()
        params = size // 4
        print(
            f"| {hidden} x {args.layers} | {params / 1e6:.2f} M | {size / 1e6:.1f} | {t:.3f} | {size / 1e6 / t:.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=96)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--fsdp-units", nargs="+", default=["auto"], choices=["auto", "layers", "model"],
        help="trainer.fsdp_units values to time side by side (one backend per world size and value)",
    )  # fmt: skip
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of the plain loop and of each rank (1: robust to load)"
    )
    ap.add_argument("--export-hidden", type=int, nargs="*", default=[128, 256, 512, 1024])
    args = ap.parse_args()

    import ray

    from fully_async.models import build_tiny_model

    torch.set_num_threads(args.threads)
    cache = Path(tempfile.mkdtemp(prefix="fa-bench-"))
    cfg = TinyModelConfig(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=4 * args.hidden)
    model_dir = build_tiny_model(cfg, cache)
    try:
        print(f"model: hidden {args.hidden}, {args.layers} layers; torch threads per process {args.threads}")
        bench_update(args, model_dir)
        if args.export_hidden:
            bench_export(args, cache)
    finally:
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    main()
