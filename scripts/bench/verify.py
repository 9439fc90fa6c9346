"""The cost of proving a weight sync (fully_async/weights/verify.py), per model size, without engine servers.

For each size the model's tensors are held in this process (float32, as the engines take them here) and timed, median
of --rounds:
- export: safetensors.save_file of the tensors into /dev/shm (what the disk transport's export costs, for scale);
- files digest: `directory_digest` of that directory (the disk transport's trainer side: a memory-mapped, sampled read);
- tensors digest: `digest` of the tensors in memory (the collective sender's side over its packed buckets, and each
  engine worker's side over what its loader takes: the same per-tensor work);
- full hash: the same with samples=0 (every element hashed), what a non-sampled checksum would cost.
The verify phase of a real sync (these digests plus one fan-out to the servers) is a column of
scripts/bench/weights.py.

    .venv/bin/python scripts/bench/verify.py                    # tiny (the default job's model), 100m
    .venv/bin/python scripts/bench/verify.py --sizes tiny,100m,500m --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's fully_async, before an installed one
# scripts/bench is on sys.path when this runs as a script: the benchmark's model sizes and its median timer
from trainer import timed  # noqa: E402
from weights import SIZES  # noqa: E402


def one_size(name: str, rounds: int) -> dict:
    from safetensors.torch import load_file, save_file

    from fully_async.config import TinyModelConfig
    from fully_async.models import build_tiny_model
    from fully_async.vllm_ext.fa_digest import digest, directory_digest

    state = load_file(build_tiny_model(TinyModelConfig(**SIZES[name])) / "model.safetensors")
    out = Path(tempfile.mkdtemp(prefix="bench-verify-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        export_s = timed(lambda: save_file(state, str(out / "model.safetensors")), rounds)  # after one warm-up
        assert directory_digest(str(out))[0] == digest(state.items())  # the two sides agree
        return {
            "size": name,
            "params": sum(t.numel() for t in state.values()),
            "bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "tensors": len(state),
            "export": export_s,
            "files": timed(lambda: directory_digest(str(out)), rounds),
            "tensors_digest": timed(lambda: digest(state.items()), rounds),
            "full": timed(lambda: digest(state.items(), samples=0), rounds),
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, of {list(SIZES)}")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    head = ["model", "params", "MB", "tensors", "export ms", "files digest ms", "tensors digest ms", "full hash ms"]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for name in args.sizes.split(","):
        r = one_size(name, args.rounds)
        print(f"| {name} | {r['params'] / 1e6:.2f} M | {r['bytes'] / 2**20:.1f} | {r['tensors']} | "
              f"{r['export'] * 1e3:.1f} | {r['files'] * 1e3:.1f} | {r['tensors_digest'] * 1e3:.1f} | "
              f"{r['full'] * 1e3:.0f} |", flush=True)  # fmt: skip
    print(f"\nmedian of {args.rounds} rounds; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
