"""MessageQueue throughput and latency through the real Ray actor.

    .venv/bin/python scripts/bench/message_queue.py            # full table (~2 min on 2 cores)
    .venv/bin/python scripts/bench/message_queue.py --quick    # fewer groups

For group sizes of ~1 KB and ~1 MB, single and batched calls, 1 and 8 producers: groups/s end to end (producers
putting while the driver gets) and p50/p99 latency of each put and get call. Target: >= 5,000 small groups/s with
batched calls on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

from fully_async.message_queue import create_message_queue
from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup, encode_groups


def group_of_bytes(index: int, nbytes: int) -> TrajectoryGroup:
    """One trajectory whose arrays take about nbytes (13 bytes per response token, 4 per prompt token)."""
    r = max(1, (nbytes - 64) // 13)
    ref = PromptRef(0, index)
    t = Trajectory(ref, 0, np.arange(16), np.arange(r) % 1000, np.full(r, -0.3), np.zeros(r), reward=1.0)
    return TrajectoryGroup(ref, [t], meta={"data_source": "bench"})


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, nbytes: int, batch: int):
        self.batch = [group_of_bytes(i, nbytes) for i in range(batch)]

    def run(self, q, calls: int) -> list[float]:
        lat = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ray.get(q.put.remote(self.batch))
            lat.append(time.perf_counter() - t0)
        return lat


def run_case(nbytes: int, batch: int, producers: int, total: int) -> dict:
    calls_per_producer = max(1, total // (batch * producers))
    total = calls_per_producer * batch * producers
    capacity = max(4 * batch * producers, 64) if nbytes < 100_000 else max(2 * batch * producers, 8)
    q = create_message_queue(capacity=capacity, max_staleness=0)
    ps = [Producer.remote(nbytes, batch) for _ in range(producers)]
    ray.get([p.__ray_ready__.remote() for p in ps])
    t0 = time.perf_counter()
    futures = [p.run.remote(q, calls_per_producer) for p in ps]
    get_lat, got = [], 0
    while got < total:
        t1 = time.perf_counter()
        got += len(ray.get(q.get.remote(min(batch, total - got), 0)))
        get_lat.append(time.perf_counter() - t1)
    wall = time.perf_counter() - t0
    put_lat = [x for f in ray.get(futures) for x in f]
    for a in [q, *ps]:
        ray.kill(a)
    return {
        "groups_per_s": total / wall,
        "put_p50_ms": 1e3 * float(np.percentile(put_lat, 50)),
        "put_p99_ms": 1e3 * float(np.percentile(put_lat, 99)),
        "get_p50_ms": 1e3 * float(np.percentile(get_lat, 50)),
        "get_p99_ms": 1e3 * float(np.percentile(get_lat, 99)),
        "groups": total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer groups per case")
    ap.add_argument("--batch", type=int, default=64, help="groups per batched put/get call")
    args = ap.parse_args()
    scale = 0.25 if args.quick else 1.0
    os.environ.setdefault("RAY_worker_niceness", "0")  # as the runner: Ray workers compete at the driver's priority
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    small = len(encode_groups([group_of_bytes(0, 1024)]))
    large = len(encode_groups([group_of_bytes(0, 1 << 20)]))
    print(f"encoded group sizes: small {small} B, large {large} B; ray {ray.__version__}, {os.cpu_count()} cores")
    print("| group | calls | producers | groups/s | put p50 ms | put p99 ms | get p50 ms | get p99 ms | groups |")
    print("|---|---|---|---|---|---|---|---|---|")
    for nbytes, label, n_single, n_batched in [(1024, "1 KB", 3000, 40000), (1 << 20, "1 MB", 300, 1000)]:
        for batch, n in [(1, n_single), (args.batch if nbytes < 100_000 else 8, n_batched)]:
            for producers in (1, 8):
                r = run_case(nbytes, batch, producers, int(n * scale))
                calls = "single" if batch == 1 else f"batch {batch}"
                print(
                    f"| {label} | {calls} | {producers} | {r['groups_per_s']:,.0f} | {r['put_p50_ms']:.2f} | "
                    f"{r['put_p99_ms']:.2f} | {r['get_p50_ms']:.2f} | {r['get_p99_ms']:.2f} | {r['groups']} |",
                    flush=True,
                )
    ray.shutdown()


if __name__ == "__main__":
    main()
