"""What the trainer is held for by the disk transport's export with the verl backend, whole against staged
(issue 26), per model size, side by side in one run: the verl backend at 1 CPU rank, median of --rounds after a
warm-up.

- whole (`export_weights`, blocking mode): the trainer waits for the full export, the gather, the cast and the
  safetensors write into /dev/shm;
- staged (`stage_weights`, background mode): the trainer waits for sending the ranks the copy into host memory
  (`send`); each rank runs the copy before any later call, so the next update's first call waits for it on the
  rank (`copy`: a no-op call on the ranks right after the stage, less the same call alone); rank 0 writes the
  files in a thread of its own, and ParamSync's `write` phase waits for them (`rest`, measured right after the
  stage, so with nothing else running beside it). What the trainer's step pays is send + copy.

    RAY_AUTH_MODE=disabled .venv/bin/python scripts/bench/staged_export.py --sizes tiny,100m --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's fully_async, before an installed one
from weights import SIZES  # noqa: E402  (scripts/bench is on sys.path when this runs as a script)


def one_size(name: str, rounds: int) -> dict[str, float]:
    from fully_async.config import AlgorithmConfig, TinyModelConfig, TrainerConfig
    from fully_async.models import build_tiny_model
    from fully_async.training import build_backend

    model = build_tiny_model(TinyModelConfig(**SIZES[name]))
    backend = build_backend(TrainerConfig(n_gpus_per_node=1, total_steps=10), AlgorithmConfig(), model, device="cpu")
    root = Path(tempfile.mkdtemp(prefix="bench-staged-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    whole, send, copy, rest = [], [], [], []

    def noop() -> None:  # a call every rank answers at once: it waits only for the calls sent before it
        backend.ranks.call_all("policy", "_query_collect_info", "train")

    try:
        for i in range(rounds + 1):  # the first round warms up
            t0 = time.perf_counter()
            backend.export_weights(root / f"w{i}")
            t1 = time.perf_counter()
            noop()
            t2 = time.perf_counter()
            finish = backend.stage_weights(root / f"s{i}")
            t3 = time.perf_counter()
            noop()
            t4 = time.perf_counter()
            finish()
            t5 = time.perf_counter()
            if i:
                whole.append(t1 - t0)
                send.append(t3 - t2)
                copy.append(max(0.0, (t4 - t3) - (t2 - t1)))
                rest.append(t5 - t4)
            shutil.rmtree(root / f"w{i}")
            shutil.rmtree(root / f"s{i}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        backend.shutdown()
    return {k: statistics.median(v) for k, v in (("whole", whole), ("send", send), ("copy", copy), ("rest", rest))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, of {list(SIZES)}")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local benchmark only
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    print("| model | whole export: held, ms | staged: send, ms | staged: copy ahead of the next call, ms | "
          "staged: written after, ms | held, staged (send + copy) / whole |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name in args.sizes.split(","):
        r = one_size(name, args.rounds)
        held = r["send"] + r["copy"]
        print(f"| {name} | {r['whole'] * 1e3:.1f} | {r['send'] * 1e3:.1f} | {r['copy'] * 1e3:.1f} | "
              f"{r['rest'] * 1e3:.1f} | {held / r['whole']:.2f} |", flush=True)  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
