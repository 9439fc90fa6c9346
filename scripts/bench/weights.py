"""Weight-sync benchmark (issue 16): one sync of the tiny -> ~100 M (-> ~0.5 B) model into real vLLM-CPU servers,
per phase, for every transport `build_transport` builds, next to the raw cost of moving the same bytes.

For each model size, two vLLM servers start once (from .venv-engine); "1 server" runs attach to the first, "2
servers" to both. Each round, in one process and interleaved (these machines are noisy: ratios are taken between
measures of the same round, then the median):
- every transport (disk; collective when this checkout has it, else a printed note) runs ParamSync.sync: pause ->
  the transport's phases -> resume, each phase timed; the "trainer" is this process holding the model's tensors
  (export = writing them as safetensors, like a backend's export);
- raw /dev/shm write: safetensors.save_file of the same tensors in the engine dtype;
- raw gloo broadcast: the same number of bytes, in buckets of --bucket-mb, from this process to 1 or 2 receiver
  processes (a gloo group of 1 + servers ranks, as the collective transport forms), twice: "cold" receives into
  freshly allocated buffers (first-touch page faults included: what a receiver that allocates per sync pays) and
  "warm" into buffers allocated and touched once before (the wire alone);
- node copy: what the disk transport adds per extra node (its `distribute` phase with engines on another node): the
  export's files put into a local Ray object store and written to /dev/shm by a task (write_node_copy).

    .venv/bin/python scripts/bench/weights.py                          # tiny and ~100M, 1 and 2 servers
    .venv/bin/python scripts/bench/weights.py --sizes tiny,100m,500m --rounds 5
    .venv/bin/python scripts/bench/weights.py --sizes 100m --servers 1 --bucket-mb 16,64,256 --transports collective

With --sync-modes blocking,background each transport also runs with the sync in the background (rows ending in "-bg"):
its `held` column is the trainer's part (disk: export; collective: stage, a copy into the staging buffers), the
engines' phases follow in ParamSync's thread (`background`); for blocking rows `held` is the whole sync.

    .venv/bin/python scripts/bench/weights.py --sizes 100m --servers 1,2 --sync-modes blocking,background

With several --bucket-mb values, each collective bucket size is its own transport row ("collective-<mb>mb"); the
raw broadcast uses the first. The collective rows also break the send phase down from what the transport reports:
the sender's pack (copy + cast into the flat buckets) and wait (on the wire, not overlapped), and per engine worker
(slowest worker) its receive, load (model_runner.reload_weights) and stall (the load waiting for the next bucket).
Where a sync is verified (async_training.verify_sync), its `verify` phase is broken down too: the trainer side's
digest (`verify_trainer_digest`; the collective sender's is taken while packing, `sender_digest`), the fan-out to
the servers (`verify_engines`) and the slowest worker's digest of its load (`verify_engine_digest`).

Prints a markdown table per size. Importing this module starts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

SIZES = {  # name -> TinyModelConfig overrides
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256),
    "100m": dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048),
    "500m": dict(hidden_size=1536, num_layers=20, num_heads=12, num_kv_heads=4, intermediate_size=4096),
}

_GLOO_RECEIVER = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
host, port, rank, world, sizes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=120))
rounds = int(store.get("rounds"))
warm = [torch.zeros(n, dtype=torch.uint8) for n in map(int, sizes.split(","))]
for r in range(rounds):
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"round{r}", store), rank, world, timedelta(seconds=600))
    for mode in ("cold", "warm"):
        pg.barrier().wait()
        for k, n in enumerate(map(int, sizes.split(","))):
            pg.broadcast(torch.empty(n, dtype=torch.uint8) if mode == "cold" else warm[k], 0).wait()
        store.set(f"done{r}-{mode}-{rank}", "1")
"""


# ---- the trainer stand-in ------------------------------------------------------------------------------------------
class TensorBackend:
    """The training backend's weight-export surface over a state dict held by this process: `export_weights` writes
    safetensors (and the model's config and tokenizer files) like a backend's export; `weight_sender` gives the
    collective transport's sending side over the same tensors, where this checkout has it."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        import torch
        from safetensors.torch import load_file

        target = getattr(torch, dtype)
        self.model_dir = model_dir
        self.state = {
            k: (v.to(target) if v.is_floating_point() else v)
            for k, v in load_file(model_dir / "model.safetensors").items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    @property
    def params(self) -> int:
        return sum(t.numel() for t in self.state.values())

    def export_weights(self, out_dir: str | Path, dtype: str = "float32", *, sync: bool = False) -> list[Path]:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.state, str(out / "model.safetensors"), metadata={"format": "pt"})
        for f in self.model_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and not (out / f.name).exists():
                shutil.copy2(f, out / f.name)
        return [out / "model.safetensors"]

    def weight_sender(self) -> Any:
        from fully_async.weights.collective_sender import CollectiveSender  # only where the collective transport exists

        return CollectiveSender(lambda: iter(self.state.items()))


class BenchRollouter:
    """The Rollouter's weight-sync surface over an engine pool: pause and resume here (the real ones also stop
    admission), every other call is the Rollouter's own method run on this object (`engine`, the engine port, over
    the pool's own `EngineService`)."""

    def __init__(self, servers: Any) -> None:
        from fully_async.engines.service import EngineService

        self.servers = servers
        self.engine_service = EngineService(servers, None)

    async def pause(self) -> None:
        await self.servers.pause("abort")

    async def resume(self) -> None:
        await self.servers.resume()

    def __getattr__(self, name: str) -> Any:
        from fully_async.rollouter import Rollouter

        fn = getattr(Rollouter, name, None)
        if fn is None or name.startswith("_"):
            raise AttributeError(name)
        return fn.__get__(self)


# ---- raw references ------------------------------------------------------------------------------------------------
def shm_write_s(backend: TensorBackend, root: Path) -> float:
    from safetensors.torch import save_file

    t = time.perf_counter()
    save_file(backend.state, str(root / "raw.safetensors"))
    return time.perf_counter() - t


def bucket_sizes(nbytes: int, bucket_bytes: int) -> list[int]:
    """The sizes of the flat buckets `nbytes` goes in (all full but the last)."""
    full, rest = divmod(nbytes, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


class GlooPeers:
    """`receivers` processes in a gloo group with this one (rank 0), for raw broadcasts of a byte count."""

    def __init__(self, receivers: int, sizes: list[int], rounds: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.dist, self.world, self.sizes = dist, receivers + 1, sizes
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=120))  # fmt: skip
        self.store.set("rounds", str(rounds))
        spec = ",".join(map(str, sizes))
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", _GLOO_RECEIVER, "127.0.0.1", str(self.store.port), str(r), str(self.world), spec]
            )  # fmt: skip
            for r in range(1, self.world)
        ]
        self.round = 0

    def broadcast_s(self) -> dict[str, float]:
        """One round: form the group (not timed), then broadcast every bucket (timed, until all receivers are done),
        receivers into fresh buffers ("gloo", cold), then into buffers touched before ("gloo_warm")."""
        from datetime import timedelta

        import torch

        pg = self.dist.ProcessGroupGloo(self.dist.PrefixStore(f"round{self.round}", self.store), 0, self.world,
                                        timedelta(seconds=600))  # fmt: skip
        bufs = [torch.zeros(n, dtype=torch.uint8) for n in self.sizes]
        out = {}
        for mode, key in (("cold", "gloo"), ("warm", "gloo_warm")):
            pg.barrier().wait()
            t = time.perf_counter()
            for buf in bufs:
                pg.broadcast(buf, 0).wait()
            for r in range(1, self.world):
                self.store.wait([f"done{self.round}-{mode}-{r}"])
            out[key] = time.perf_counter() - t
        self.round += 1
        return out

    def close(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def node_copy_s(export_dir: Path, version: int) -> float:
    """The disk transport's per-node copy on this machine: files into a local Ray object store, written to /dev/shm
    by a Ray task (the engine host's write on another node)."""
    import ray

    from fully_async.weights.disk import file_chunks, node_root, write_node_copy

    @ray.remote(num_cpus=0)
    def write(name: str, v: int, files: list) -> str:
        return str(write_node_copy(name, v, files, ray.get))

    name = f"fully_async-weights-bench-{os.getpid()}"
    t = time.perf_counter()
    files = file_chunks(export_dir, ray.put)
    ray.get(write.remote(name, version, files))
    elapsed = time.perf_counter() - t
    del files
    shutil.rmtree(node_root(name), ignore_errors=True)
    return elapsed


# ---- the run -------------------------------------------------------------------------------------------------------
def transports(kinds: list[str], backend: Any, root: Path, dtype: str) -> dict[str, str | None]:
    """kind -> None when this checkout builds it, else why not (printed as a note)."""
    from fully_async.config import ConfigError
    from fully_async.weights import build_transport

    out: dict[str, str | None] = {}
    for kind in kinds:
        try:
            build_transport(kind, None, backend, root / f"probe-{kind}", dtype).close()
            out[kind] = None
        except (ConfigError, ImportError, AttributeError, TypeError) as e:
            out[kind] = f"{type(e).__name__}: {e}"
    return out


def one_size(name: str, args, kinds: dict[str, str | None]) -> list[dict[str, Any]]:
    from fully_async.config import EngineConfig, TinyModelConfig
    from fully_async.engines import build_engine
    from fully_async.handles import LocalActor
    from fully_async.models import build_tiny_model
    from fully_async.sync import ParamSync

    model = build_tiny_model(TinyModelConfig(**SIZES[name]))
    backend = TensorBackend(model, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="bench-weights-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    cfg = EngineConfig(num_servers=2, max_model_len=256, kv_cache_gib=args.kv_gib, startup_timeout_s=1200,
                       control_timeout_s=600, dtype=args.dtype)  # fmt: skip
    # The collective transport's worker extension is on the command line from the start (harmless for disk).
    launched = build_engine(cfg, model, work / "run")
    t0 = time.perf_counter()
    launched.start()
    print(f"[{name}] 2 vLLM servers healthy in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    try:
        for count in args.servers:
            pool = build_engine(cfg, model, work / "run", addresses=launched.addresses[:count])
            handle = LocalActor(BenchRollouter(pool))
            syncs = {}
            for kind, why in kinds.items():
                if why is not None:
                    continue
                for label, kwargs in _variants(kind, args):
                    syncs[label] = ParamSync(handle, backend, work / label, args.dtype, 1200.0, transport=kind,
                                             **kwargs)  # fmt: skip
            sizes = bucket_sizes(backend.nbytes, args.bucket_mb[0] << 20)
            peers = GlooPeers(count, sizes, args.rounds + 1)
            measures: dict[str, list[float]] = {}
            try:
                for r in range(args.rounds + 1):  # round 0 warms up (and runs the collective's connect)
                    got: dict[str, float] = {**peers.broadcast_s(), "shm": shm_write_s(backend, work)}
                    collectives = [kind for kind in syncs if kind.startswith("collective")]
                    for kind, sync in syncs.items():
                        if kind in collectives and len(collectives) > 1:  # the servers' workers: one group at a time
                            sync.transport.prepare(handle)
                        timings = timed_sync(sync, r + 1)
                        got[kind] = timings["timing_s/param_sync"]
                        for k, v in timings.items():
                            if k.startswith("timing_s/param_sync/") and not k.endswith("/connect"):
                                got[f"{kind}/{k.rsplit('/', 1)[1]}"] = v
                        got.update({f"{kind}/{k}": v for k, v in send_breakdown(sync.transport).items()})
                    if "disk" in syncs:
                        got["node_copy"] = node_copy_s(work / "disk" / f"v{r + 1}", r + 1)
                    if r == 0:
                        continue
                    for k, v in got.items():
                        measures.setdefault(k, []).append(v)
                    for kind in syncs:  # ratios within the round
                        measures.setdefault(f"{kind}/gloo", []).append(got[kind] / got["gloo"])
                        measures.setdefault(f"{kind}/gloo_warm", []).append(got[kind] / got["gloo_warm"])
                        measures.setdefault(f"{kind}/shm", []).append(got[kind] / got["shm"])
                        if kind.startswith("collective") and "disk" in syncs:
                            measures.setdefault(f"{kind}/disk", []).append(got[kind] / got["disk"])
            finally:
                peers.close()
                for sync in syncs.values():
                    sync.close()
                handle.close()
            rows.append({"size": name, "servers": count, "params": backend.params, "bytes": backend.nbytes,
                         **{k: statistics.median(v) for k, v in measures.items()}})  # fmt: skip
    finally:
        launched.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _variants(kind: str, args) -> list[tuple[str, dict[str, Any]]]:
    """(row label, ParamSync kwargs) per transport: one per --bucket-mb value for the collective one, each once per
    --sync-modes value (background rows end in "-bg")."""
    if kind != "collective":
        sized = [(kind, {})]
    elif len(args.bucket_mb) == 1:
        sized = [(kind, {"bucket_mb": args.bucket_mb[0]})]
    else:
        sized = [(f"collective-{mb}mb", {"bucket_mb": mb}) for mb in args.bucket_mb]
    return [(label + ("-bg" if mode == "background" else ""), {**kwargs, "mode": mode})
            for mode in args.sync_modes for label, kwargs in sized]  # fmt: skip


def timed_sync(sync: Any, version: int) -> dict[str, float]:
    """One sync's phase timings, with `held`: the seconds the caller (the trainer) was held. Background mode: the
    sync returns once the trainer's phases ran (export or stage) and `wait` then collects the engines' phases, which
    a trainer would overlap with its next step; the sync's total is held + background."""
    timings = sync.sync(version)
    held = timings["timing_s/param_sync"]
    if sync.mode == "background":
        timings.update(sync.wait())
        timings["timing_s/param_sync"] = held + timings["timing_s/param_sync/background"]
    return {**timings, "timing_s/param_sync/held": held}


def send_breakdown(transport: Any) -> dict[str, float]:
    """What the collective transport's last send reported, in seconds: the sender's pack and wait, and the slowest
    engine worker's value of each of its timings (receive_s, load_s, ...). Empty for other transports."""
    last = getattr(transport, "last", None) or {}
    out = {}
    sender = last.get("sender") or {}
    for key in ("pack_s", "wait_s", "digest_s"):
        if key in sender:
            out[f"sender_{key[:-2]}"] = sender[key]
    workers = [w for answer in last.get("engines") or [] for w in (answer if isinstance(answer, list) else [answer])]
    for key in sorted({k for w in workers if isinstance(w, dict) for k in w if k.endswith("_s")}):
        out[f"engine_{key[:-2]}"] = max(w.get(key, 0.0) for w in workers)
    verifier = getattr(transport, "verifier", None)  # the verify phase's parts (weights/verify.py), where it ran
    out.update({f"verify_{key[:-2]}": v for key, v in (getattr(verifier, "last_s", None) or {}).items()})
    return out


def table(rows: list[dict[str, Any]], kinds: list[str]) -> str:
    lines = []
    kinds = sorted(
        {k for r in rows for k in r if "/" not in k and any(k == kind or k.startswith(kind + "-") for kind in kinds)}
    )
    for kind in kinds:
        phases = sorted(
            {k.split("/", 1)[1] for r in rows for k in r if k.startswith(kind + "/")}
            - {"gloo", "gloo_warm", "shm", "disk"}
        )
        head = ["model", "params", "MB", "servers", *(f"{p} ms" for p in phases), f"{kind} sync ms",
                "/dev/shm write ms", "gloo bcast ms", "gloo warm ms", "node copy ms", "sync / write", "sync / gloo",
                "sync / gloo warm"]  # fmt: skip
        if kind.startswith("collective"):
            head.append("collective / disk")
        lines += [f"\n{kind}\n", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in rows:
            if kind not in r:
                continue
            cells = [r["size"], f"{r['params'] / 1e6:.1f} M", f"{r['bytes'] / 2**20:.0f}", str(r["servers"]),
                     *(f"{r.get(f'{kind}/{p}', float('nan')) * 1e3:.0f}" for p in phases),
                     f"{r[kind] * 1e3:.0f}", f"{r['shm'] * 1e3:.0f}", f"{r['gloo'] * 1e3:.0f}",
                     f"{r['gloo_warm'] * 1e3:.0f}", f"{r.get('node_copy', float('nan')) * 1e3:.0f}",
                     f"{r[f'{kind}/shm']:.2f}", f"{r[f'{kind}/gloo']:.2f}", f"{r[f'{kind}/gloo_warm']:.2f}"]  # fmt: skip
            if kind.startswith("collective"):
                cells.append(f"{r.get(f'{kind}/disk', float('nan')):.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, of {list(SIZES)}")
    ap.add_argument("--servers", default="1,2", help="engine server counts")
    ap.add_argument("--transports", default="disk,collective")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per cell, after one warm-up")
    ap.add_argument("--dtype", default="float32", help="engine dtype (vLLM-CPU's default is float32)")
    ap.add_argument(
        "--bucket-mb", default="16", help="collective bucket sizes, comma-separated (the raw broadcast uses the first)"
    )
    ap.add_argument("--sync-modes", default="blocking",
                    help="async_training.sync_mode values, comma-separated: each transport runs once per mode "
                    "(background rows end in -bg; their `held` column is what the trainer waits for)")  # fmt: skip
    ap.add_argument("--kv-gib", type=int, default=1, help="KV cache per server (GiB, whole: vLLM-CPU rounds down)")
    args = ap.parse_args()
    args.servers = [int(s) for s in args.servers.split(",")]
    args.bucket_mb = [int(s) for s in args.bucket_mb.split(",")]
    args.sync_modes = args.sync_modes.split(",")

    import ray

    from fully_async.config import TinyModelConfig
    from fully_async.models import build_tiny_model

    probe = TensorBackend(build_tiny_model(TinyModelConfig(**SIZES["tiny"])), args.dtype)
    with tempfile.TemporaryDirectory() as d:
        kinds = transports(args.transports.split(","), probe, Path(d), args.dtype)
    for kind, why in kinds.items():
        if why is not None:
            print(f"note: transport {kind} skipped: build_transport refused it ({why})", flush=True)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    rows = []
    try:
        for name in args.sizes.split(","):
            rows += one_size(name, args, kinds)
            print(json.dumps(rows[-len(args.servers) :]), file=sys.stderr, flush=True)  # the raw medians
            print(table(rows[-len(args.servers) :], [k for k, w in kinds.items() if w is None]), flush=True)
    finally:
        ray.shutdown()
    print(
        f"\nall sizes, median of {args.rounds} rounds (ratios: median of per-round ratios); load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(table(rows, [k for k, w in kinds.items() if w is None]))


if __name__ == "__main__":
    main()
