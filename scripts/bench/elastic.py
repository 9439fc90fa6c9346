"""What growing the engine pool buys and what losing an engine node costs, measured on one running job.

A 3-node loopback cluster started with the launch scripts (head: driver + trainer rank, 1 declared GPU and the
custom resource trainer_node; two workers with 2 declared GPUs and engine_node each), the default task with vLLM-CPU
engines, one server at start:

  window 1   --window steps with 1 server
  --add 1    seconds until `ctl --add` returns (joined at the current version) and until the new server has served
  window 2   --window steps with 2 servers
  node loss  every process of the node of server 1 killed by pid; seconds until the replacement serves; steps the
             trainer completed meanwhile (none are lost: the other server goes on)
  window 3   --window steps after the replacement

Per window: steps/s and generated tokens/s (perf/generated_tokens_per_s averaged over the window's steps), ratios to
window 1 side by side. On this 2-core machine a second server adds no cores, so window 2 shows the cost of sharing
them, not a speed-up; on a GPU cluster each server brings its own GPUs.

    .venv/bin/python scripts/bench/elastic.py --window 12
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local loopback clusters only
sys.path.insert(0, str(REPO))  # tests/local_cluster.py runs the checkout's scripts/cluster/

from tests.local_cluster import script_env, start_cluster  # noqa: E402


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def wait(what: str, check, timeout: float, driver: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        if driver.poll() is not None:
            raise SystemExit(f"the job ended while waiting for {what}")
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def window(run_dir: Path, start: int, count: int, driver) -> dict[str, float]:
    """Steps start+1 .. start+count: steps/s from their timestamps, mean generated tokens/s."""
    rows = wait(f"steps {start + 1}..{start + count}", lambda: s if len(s := steps(run_dir)) >= start + count else None,
                1800, driver)[start : start + count]  # fmt: skip
    span = rows[-1]["timestamp"] - rows[0]["timestamp"] + rows[0]["timing_s/step"]
    tokens = sum(r["perf/generated_tokens_per_s"] for r in rows) / len(rows)
    return {"steps_per_s": len(rows) / span, "gen_tokens_per_s": tokens, "last_step": start + count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=12, help="steps per measured window")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps before window 1")
    args = parser.parse_args()
    cluster = start_cluster(head_gpus=1, worker_gpus=(2, 2), cpus_per_node=8, head_resources={"trainer_node": 10},
                            worker_resources={"engine_node": 10})  # fmt: skip
    env = script_env(RAY_ADDRESS=cluster.gcs_address)
    tmp = Path(tempfile.mkdtemp(prefix="fa-bench-elastic-"))
    run_dir = tmp / "run"

    def ctl(*a: str) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-m", "fully_async.ctl", *a], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=900)  # fmt: skip
        if out.returncode:
            raise SystemExit(f"ctl {' '.join(a)} failed: {out.stderr}")
        return out

    def rows() -> list[dict]:
        return [json.loads(x) for x in ctl("engines", "--list", "--json").stdout.splitlines() if x.startswith("{")]

    with open(tmp / "driver.log", "w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "fully_async.runner", "trainer.device=cpu", "placement.resources=gpu",
             "engine.num_servers=1", "trainer.total_steps=100000", "engine.replace_retry_s=5",
             "+placement.engine_resources.engine_node=1", "+placement.trainer_resources.trainer_node=1",
             f"hydra.run.dir={run_dir}", "logger=[jsonl]"],
            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    result: dict[str, float | dict] = {}
    try:
        w1 = window(run_dir, args.skip, args.window, driver)
        start = time.monotonic()
        ctl("engines", "--add", "1")
        joined_s = time.monotonic() - start
        wait("the new server to serve", lambda: True if rows()[1]["busy_s"] > 0 else None, 300, driver)
        served_s = time.monotonic() - start
        w2 = window(run_dir, len(steps(run_dir)), args.window, driver)
        victim = rows()[1]
        leader = cluster.leader_of_node(victim["node_id"])
        before = len(steps(run_dir))
        lost_at = time.monotonic()
        os.killpg(leader, signal.SIGKILL)
        wait("the replacement", lambda: True if (r := rows()[1])["state"] == "serving" and r["url"] != victim["url"]
             and r["busy_s"] > 0 else None, 900, driver)  # fmt: skip
        recover_s = time.monotonic() - lost_at
        during = len(steps(run_dir)) - before
        w3 = window(run_dir, len(steps(run_dir)), args.window, driver)
        result = {"window_1_server": w1, "add_joined_s": joined_s, "add_first_served_s": served_s,
                  "window_2_servers": w2, "node_loss_recover_s": recover_s, "steps_during_recovery": during,
                  "window_after_replacement": w3}  # fmt: skip
    finally:
        if driver.poll() is None:
            driver.send_signal(signal.SIGTERM)
            try:
                driver.wait(timeout=180)
            except subprocess.TimeoutExpired:
                driver.kill()
        cluster.stop()
    base = result["window_1_server"]
    print(f"{'window':<26} {'steps/s':>8} {'gen tok/s':>10} {'steps/s ratio':>14} {'tok/s ratio':>12}")
    for name in ("window_1_server", "window_2_servers", "window_after_replacement"):
        w = result[name]
        print(f"{name:<26} {w['steps_per_s']:>8.3f} {w['gen_tokens_per_s']:>10.1f} "
              f"{w['steps_per_s'] / base['steps_per_s']:>14.2f} {w['gen_tokens_per_s'] / base['gen_tokens_per_s']:>12.2f}")  # fmt: skip
    print(
        f"--add 1: joined after {result['add_joined_s']:.1f} s, first served after {result['add_first_served_s']:.1f} s"
    )
    print(f"node loss: replacement serving after {result['node_loss_recover_s']:.1f} s; "
          f"{result['steps_during_recovery']} steps trained meanwhile (none lost)")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
