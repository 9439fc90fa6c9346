"""scripts/cluster/ on a real 2-node Ray cluster on loopback (the two_node_cluster fixture: started by start_head.sh
and start_worker.sh, waited for by wait.sh, stopped by stop.sh at the end of the session, which must leave no process
the scripts started): the nodes and their declared GPUs, a job submitted by submit.sh with its environment and exit
status, and the wait script's timeout."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.local_cluster import REPO, run_script

pytestmark = pytest.mark.slow

TOKEN = "hf_test_secret_8d1f"
PROBE = """
import hashlib, json, os, pathlib, sys, time, ray
ray.init()
nodes = [{"alive": n["Alive"], "ip": n["NodeManagerAddress"], "gpus": n["Resources"].get("GPU", 0)} for n in ray.nodes()]

@ray.remote(num_gpus=2)
class GpuActor:
    def where(self):
        return ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()

actor = GpuActor.remote()
print("PROBE " + json.dumps({
    "nodes": nodes,
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "token_sha": hashlib.sha256(os.environ.get("HF_TOKEN", "").encode()).hexdigest(),
    "nccl": os.environ.get("NCCL_SOCKET_IFNAME"),
    "niceness": os.environ.get("RAY_worker_niceness"),
    "driver_pid": os.getpid(),
    "gpu_actor": ray.get(actor.where.remote()),
    "worker_node": [n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")],
}), flush=True)
release = pathlib.Path(os.environ["PROBE_RELEASE"])
while not release.exists():  # the test looks at the live processes, then releases the job
    time.sleep(0.1)
"""


def _probe(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, stdout
    return json.loads(lines[-1][len("PROBE ") :])


def test_a_submitted_job_sees_both_nodes_the_worker_gpus_and_its_environment(two_node_cluster, tmp_path):
    release = tmp_path / "release"
    job = two_node_cluster.submit_background(
        "--python-c", PROBE, "--env", "PROBE_RELEASE", "trainer.total_steps=2", "logger=[console, jsonl]",
        HF_TOKEN=TOKEN, NCCL_SOCKET_IFNAME="lo", PROBE_RELEASE=str(release),
    )  # fmt: skip
    try:
        lines = []
        for line in job.stdout:  # the job's log, followed by submit.sh, up to the probe's line
            lines.append(line)
            if line.startswith("PROBE "):
                break
        probe = _probe("".join(lines))
        # While the job runs: its driver under the head node, the GPU actor under the worker node.
        assert two_node_cluster.node_of(probe["driver_pid"]).startswith("head-")
        assert two_node_cluster.node_of(probe["gpu_actor"][2]).startswith("worker-")
    finally:
        release.touch()
        rest, _ = job.communicate(timeout=120)
    stdout = "".join(lines) + rest
    assert job.returncode == 0, stdout
    assert [n["alive"] for n in probe["nodes"]] == [True, True]
    assert sorted(n["gpus"] for n in probe["nodes"]) == [0, 4]  # head none, worker 4
    assert {n["ip"] for n in probe["nodes"]} == {"127.0.0.2"}  # loopback only
    # The GPU actor lands on the worker node with the 2 devices Ray gave it.
    node, devices, _ = probe["gpu_actor"]
    assert [node] == probe["worker_node"] and len(devices.split(",")) == 2
    # Hydra overrides arrive as they were written (spaces included); the job runs from the repository.
    assert probe["argv"] == ["trainer.total_steps=2", "logger=[console, jsonl]"]
    assert probe["cwd"] == str(REPO)
    assert probe["token_sha"] == hashlib.sha256(TOKEN.encode()).hexdigest()  # the job has the token ...
    assert TOKEN not in stdout  # ... and nothing printed it
    assert probe["nccl"] == "lo" and probe["niceness"] == "0"
    assert "HF_TOKEN" in stdout  # the names are printed


def test_submit_runs_the_runner_and_exits_with_its_exit_status(two_node_cluster, tmp_path):
    # The default entrypoint (python -m fully_async.runner) with Hydra arguments; a bad value makes the runner exit
    # 2 with a ConfigError before it starts anything, and submit.sh exits with that status.
    out = two_node_cluster.submit("rollout.n=0", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2, out.stdout
    assert "ConfigError" in out.stdout and "rollout.n" in out.stdout
    assert "-m fully_async.runner rollout.n=0" in out.stdout  # the entrypoint it printed


def test_wait_times_out_with_what_is_missing(two_node_cluster):
    out = run_script("wait.sh", "--temp-dir", str(two_node_cluster.temp_dir), "--nodes", "3", "--gpus", "4",
                     "--timeout", "2", "--interval", "0.5")  # fmt: skip
    assert out.returncode == 1, out.stdout
    assert "2 of 3 nodes alive, 4 of 4 GPUs" in out.stdout, out.stdout
