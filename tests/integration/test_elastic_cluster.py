"""The elastic engine pool of a running job on a 3-node Ray cluster on loopback, with vLLM-CPU engines, driven by
`python -m fully_async.ctl` from another process, as an operator would:

head: the driver and the trainer rank (it declares 1 GPU and the custom resource `trainer_node`); two workers with
2 GPUs and `engine_node` each, where placement.engine_resources keeps the engine servers. The job starts with one
server; while it trains: `--add 1` (the new server serves), `--remove` the first (its requests finish on the new
one), then every process of the node of the remaining server is killed by pid (its raylet included): the server is
replaced on a worker that is still alive, the requests waiting meanwhile go on there, and the run goes on. (At most
two vLLM-CPU servers live at once: the machine has 24 GB for three raylets, the trainer and the engines.) The job is then stopped with SIGTERM; every trained prompt was trained once, as a whole group, within the
staleness bound. The mechanisms are tested fast, with fake servers, in tests/integration/test_engine_pool.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.local_cluster import REPO, script_env, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

N, GROUPS, ETA = 2, 2, 1
PACE = f"reward.sources=[{{kind: rule, limits: {{rpm: {60 * N * GROUPS // 2}, scope: process}}}}]"
"""The rule reward held to one step's samples every 2 s (reward.sources.limits). Left free, the loop trains ~3 steps a
second on both cores (hundreds of steps nobody checks) and the engine launch of the add, which the test waits for,
crawls beside it: measured on 2 cores, the join took 102 s free, 46 s paced."""


def _ctl(cluster, *args: str) -> subprocess.CompletedProcess:
    env = script_env(RAY_ADDRESS=cluster.gcs_address)
    return subprocess.run([sys.executable, "-m", "fully_async.ctl", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def _rows(cluster) -> list[dict]:
    out = _ctl(cluster, "engines", "--list", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _wait(what: str, check, timeout: float, driver: subprocess.Popen, log: Path, every: float = 0.2):
    """`check()` until it returns a value, every `every` seconds (checks that read the run's files are cheap; one that
    starts a ctl process passes 1 s: each start imports Ray and joins the cluster, on the cores the engines use)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        assert driver.poll() is None, f"the job ended while waiting for {what}:\n{log.read_text()[-4000:]}"
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}:\n{log.read_text()[-4000:]}")


def test_grow_shrink_and_lose_an_engine_node_while_the_job_trains(tmp_path):
    cluster = start_cluster(head_gpus=1, worker_gpus=(2, 2), cpus_per_node=8, head_resources={"trainer_node": 10},
                            worker_resources={"engine_node": 10})  # fmt: skip
    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    driver = None
    try:
        with open(log, "w") as out:
            driver = subprocess.Popen(
                [sys.executable, "-m", "fully_async.runner", "trainer.device=cpu", "placement.resources=gpu",
                 "engine.num_servers=1", "trainer.total_steps=100000", f"async_training.groups_per_step={GROUPS}",
                 f"rollout.n={N}", f"async_training.max_staleness={ETA}", "engine.replace_retry_s=5", PACE,
                 "+placement.engine_resources.engine_node=1", "+placement.trainer_resources.trainer_node=1",
                 f"hydra.run.dir={run_dir}", "logger=[jsonl]"],
                env=script_env(RAY_ADDRESS=cluster.gcs_address), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _wait("two steps", lambda: True if len(_steps(run_dir)) >= 2 else None, 600, driver, log)
        record = json.loads((run_dir / "placement.json").read_text())
        workers = {n["node_id"] for n in record["nodes"] if n["gpus"] == 2}
        rows = _rows(cluster)
        assert [r["state"] for r in rows] == ["serving"] and rows[0]["node_id"] in workers

        # Grow: the new server joins, then takes requests.
        added = _ctl(cluster, "engines", "--add", "1")
        assert added.returncode == 0 and "joined in" in added.stdout, added.stdout + added.stderr
        _wait("the new server to serve", lambda: True if (r := _rows(cluster)) and len(r) == 2 and r[1]["busy_s"] > 0
              else None, 120, driver, log, every=1.0)  # fmt: skip

        # Shrink: server 0 leaves; its requests go on elsewhere.
        gone = rows[0]["url"]
        removed = _ctl(cluster, "engines", "--remove", gone)
        assert removed.returncode == 0 and f"removed {gone}" in removed.stdout, removed.stdout + removed.stderr
        rows = _rows(cluster)
        assert [r["state"] for r in rows] == ["removed", "serving"]
        refused = _ctl(cluster, "engines", "--remove", "http://127.0.0.9:1")
        assert refused.returncode == 1 and "no engine server at http://127.0.0.9:1" in refused.stderr

        # Lose a node: kill every process of the node of server 1 (raylet, workers, engine host, server), the last one.
        victim = rows[1]
        os.killpg(cluster.leader_of_node(victim["node_id"]), signal.SIGKILL)
        lost_at = time.monotonic()

        def replaced():
            # Asked with ctl only once a step's counters show the replacement (counted once it is healthy): the new
            # server's launch takes ~40 s, and a ctl process every second would take the cores it launches on.
            if not (s := _steps(run_dir)) or s[-1].get("fully_async/count/engine_replacements", 0) < 1:
                return None
            r = _rows(cluster)
            return r if r[1]["state"] == "serving" and r[1]["url"] != victim["url"] and r[1]["node_id"] else None

        rows = _wait("the lost server's replacement", replaced, 400, driver, log, every=1.0)
        recovered_s = time.monotonic() - lost_at
        assert rows[1]["node_id"] in workers - {victim["node_id"]}  # on a worker still alive
        at = len(_steps(run_dir))
        _wait("two more steps", lambda: True if len(_steps(run_dir)) >= at + 2 else None, 300, driver, log)
        driver.send_signal(signal.SIGTERM)
        # 130: the runner's own exit after shutting everything down. After a node loss Ray's core worker sometimes
        # aborts (-6) inside the final ray.shutdown(), once the job's parts are stopped; either way it must end.
        exit_code = driver.wait(timeout=180)
        assert exit_code in (130, -signal.SIGABRT), log.read_text()[-4000:]
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        cluster.stop()
    print(f"replacement seen serving {recovered_s:.1f} s after the node loss; driver exit {exit_code}")  # with -s
    steps = _steps(run_dir)
    last = steps[-1]
    assert last["fully_async/count/engine_joins"] == 1 and last["fully_async/count/engine_leaves"] == 1
    assert last["fully_async/count/engine_replacements"] == 1 and last["fully_async/engines/pool_size"] == 1
    assert last["fully_async/engines/pool_down"] == 0  # the replacement serves
    assert any("timing_s/engines/join" in s for s in steps)
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines() if line]
    per_group = Counter((t["prompt_uid"], t["epoch"]) for t in trajs)
    assert set(per_group.values()) == {N}  # whole groups, each trained once
    per_step = Counter(t["step"] for t in trajs)
    assert sorted(per_step) == list(range(1, max(per_step) + 1)) >= list(range(1, len(steps) + 1))
    assert set(per_step.values()) == {N * GROUPS}  # every step trained its groups, nothing lost
    assert len({(t["prompt_uid"], t["epoch"], t["sample_index"]) for t in trajs}) == len(trajs)
    assert all(t["trained_version"] - t["min_version"] <= ETA for t in trajs)
