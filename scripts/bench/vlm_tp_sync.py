"""Weight sync of the tiny Qwen2-VL into a vLLM-CPU server at engine.tensor_parallel_size=1 and =2, side by side in
one run (issue 37): seconds of a collective sync (gloo; world 1 + TP) and of a disk reload, bytes sent, and the
server's start.

For each TP a server of the tiny Qwen2-VL starts (its start timed), then takes `--rounds` collective syncs and
`--rounds` disk syncs of the language model (tower frozen: never sent), alternating two models so that every sync
changes the weights; each sync is verified (every rank's digest). Seconds: ParamSync.sync wall time, the first
sync (the collective's forms the weight group) apart from the median of the rest.
Needs .venv-engine (vLLM-CPU); one server at a time.

    .venv/bin/python scripts/bench/vlm_tp_sync.py --rounds 4

Prints a markdown table. Importing this module starts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASE = "timing_s/param_sync/"


def one_tp(tp: int, models: tuple[Path, Path], rounds: int, tmp: Path) -> dict[str, float]:
    from fully_async.config import EngineConfig
    from fully_async.engines import build_engine
    from fully_async.handles import LocalActor
    from fully_async.sync import ParamSync
    from fully_async.weights.collective import CollectiveTransport
    from fully_async.weights.collective_sender import staging_bytes
    from tests.fakes import ServersRollouter
    from tests.integration.test_vlm_weights_collective import frozen_tower_backend

    start, target = models
    cfg = EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=900, dtype="float32",
                       tensor_parallel_size=tp)  # fmt: skip
    servers = build_engine(cfg, start, tmp / f"run-tp{tp}", device="cpu")
    t0 = time.perf_counter()
    servers.start()
    started = time.perf_counter() - t0
    handle = LocalActor(ServersRollouter(servers))
    backend = frozen_tower_backend(target, "cpu")
    states = [backend.state, frozen_tower_backend(start, "cpu").state]
    out: dict[str, float] = {"start_s": started}
    version = 0
    try:
        for transport in ("collective", "disk"):
            root = tmp / f"w-tp{tp}-{transport}"
            if transport == "collective":  # built once, as a run does: the group forms at the first sync
                built = CollectiveTransport(handle, backend, root, "float32", bucket_mb=16, sync_timeout_s=120.0,
                                            device="cpu")  # fmt: skip
                sync = ParamSync(handle, backend, root, "float32", 120.0, transport=built)
            else:
                sync = ParamSync(handle, backend, root, "float32", 120.0)
            seconds, phases = [], []
            try:
                for r in range(rounds):
                    backend.state, version = states[r % 2], version + 1  # every sync changes the weights
                    t0 = time.perf_counter()
                    timings = sync.sync(version)
                    seconds.append(time.perf_counter() - t0)
                    assert timings["fully_async/param_sync/verified_servers"] == 1.0
                    phases.append({k.split("/")[-1]: v for k, v in timings.items() if k.startswith(PHASE)})
            finally:
                sync.close(remove=False)
            for name in phases[0]:  # where the seconds go: the median of syncs 2.. per phase
                out[f"{transport} {name}"] = statistics.median(p.get(name, 0.0) for p in phases[1:] or phases)
            out[f"{transport}_first_s"], out[f"{transport}_s"] = seconds[0], statistics.median(seconds[1:] or seconds)
            if transport == "collective":
                out["collective_bytes"] = staging_bytes(backend.sender.plan(), "float32")
            else:
                out["disk_bytes"] = max(sum(f.stat().st_size for f in d.glob("*.safetensors"))
                                        for d in [root, *root.rglob("*")] if d.is_dir())  # fmt: skip
    finally:
        handle.close()
        servers.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from tests.integration.test_vlm_weights_collective import vlm_pair

    rows = {}
    with tempfile.TemporaryDirectory(prefix="fa-vlm-tp-") as d:
        models = vlm_pair(Path(d) / "models")
        for tp in (1, 2):
            rows[tp] = one_tp(tp, models, args.rounds, Path(d))
    print(f"\ntiny Qwen2-VL, tower frozen, float32, vLLM-CPU; the median of syncs 2..{args.rounds} per transport\n")
    print("| engine TP | server start s | collective: first sync s (forms the group) | collective sync s | "
          "collective bytes | disk: first sync s | disk sync s | disk bytes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for tp, r in rows.items():
        print(f"| {tp} | {r['start_s']:.1f} | {r['collective_first_s']:.3f} | {r['collective_s']:.3f} | "
              f"{r['collective_bytes']:,} | {r['disk_first_s']:.3f} | {r['disk_s']:.3f} | {r['disk_bytes']:,} |")  # fmt: skip
    one, two = rows[1], rows[2]
    print("\n| phase (median s) | TP=1 | TP=2 |\n|---|---|---|")
    for key in (k for k in one if " " in k):
        print(f"| {key} | {one[key]:.3f} | {two.get(key, 0.0):.3f} |")
    print(f"\nTP=2 / TP=1: collective sync {two['collective_s'] / one['collective_s']:.2f}x, disk sync "
          f"{two['disk_s'] / one['disk_s']:.2f}x, start {two['start_s'] / one['start_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
