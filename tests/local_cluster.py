"""A multi-node Ray cluster on this machine, started, used and stopped only through scripts/cluster/ (the CPU twin of
a GPU cluster: nodes DECLARE GPUs with --num-gpus; Ray hands them out as CUDA_VISIBLE_DEVICES; nothing uses them).
Tests (tests/cluster.py's session fixture) and the benchmarks (scripts/bench/, which put the repository root on
sys.path first) start theirs here; a user can too, to try a multi-node run on one box from a checkout
(docs/cluster.md). It is no part of the package: it runs the repository's scripts, which an installed package lacks.

`start_cluster()` starts a head and workers with start_head.sh / start_worker.sh in a private temp dir and waits with
wait.sh; `LocalCluster.submit()` runs submit.sh; `LocalCluster.stop()` runs stop.sh and returns what it left running.
`node_tree` / `signal_all` stop, continue or kill one node's processes by the pid its start recorded (a hung node).

Nodes advertise 127.0.0.2, not 127.0.0.1: `ray start` rewrites 127.0.0.1 / localhost as a node IP to the host's
network address (ray._private.services.resolve_ip_for_localhost), while any other 127.x address is kept, and the
whole of 127.0.0.0/8 is loopback on Linux. Ports are picked free, Ray's token auth is off (RAY_AUTH_MODE=disabled:
local clusters only), Ray workers run at niceness 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
"""The checkout this module runs from: the cluster scripts are files of the repository, not of the package."""
SCRIPTS = REPO / "scripts" / "cluster"
NODE_IP = "127.0.0.2"


def free_port() -> int:
    """A loopback port free a moment ago (kept here, not imported from engines/: this module stays import-light)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env(**extra: str) -> dict[str, str]:
    """The environment the scripts run with: this interpreter's venv, auth off (loopback clusters only), niceness 0."""
    env = dict(os.environ)
    env.update(FA_VENV=sys.prefix, RAY_AUTH_MODE="disabled", RAY_worker_niceness="0", RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)  # the scripts take the cluster from --temp-dir, never from a stray variable
    env.update(extra)
    return env


def run_script(name: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None, cwd=None):
    """Run scripts/cluster/NAME with bash (from `cwd`, default this process's); stdout and stderr together in .stdout."""
    if not (SCRIPTS / name).is_file():
        raise FileNotFoundError(f"{SCRIPTS / name} not found: the local cluster runs from a checkout of the repository")
    return subprocess.run(["bash", str(SCRIPTS / name), *args], env=env or script_env(), timeout=timeout, cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


@dataclasses.dataclass
class LocalCluster:
    temp_dir: Path
    gcs_address: str
    """IP:PORT of the head's GCS (RAY_ADDRESS for a driver)."""
    api_address: str
    """http://HOST:PORT of the job API (for `ray job submit`)."""

    @property
    def state_dir(self) -> Path:
        return self.temp_dir / "fully_async"

    def submit(self, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        """submit.sh --temp-dir TEMP ARGS (a run of fully_async.runner by default; `--python-c CODE` for a check),
        with `env` added to the submitting environment (submit.sh passes what it knows to the job)."""
        return run_script("submit.sh", "--temp-dir", str(self.temp_dir), *args, timeout=timeout, env=script_env(**env))

    def submit_background(self, *args: str, **env: str) -> subprocess.Popen:
        """submit() without waiting: the caller reads .stdout (stderr merged) while the job runs and waits for it."""
        return subprocess.Popen(["bash", str(SCRIPTS / "submit.sh"), "--temp-dir", str(self.temp_dir), *args],
                                env=script_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip

    def node_of(self, pid: int) -> str | None:
        """Which started node a live process runs under: the name of the pid file (head-N, worker-N) of the
        `ray start` it descends from (through the raylet), or None."""
        leaders = {int(f.read_text()): f.stem for f in self.state_dir.glob("*.pid")}
        try:
            return next((leaders[p.pid] for p in psutil.Process(pid).parents() if p.pid in leaders), None)
        except psutil.NoSuchProcess:
            return None

    def leader_of_node(self, node_id: str) -> int:
        """The `ray start --block` process (leading the node's process group) of the started node with this Ray node
        id, found through its raylet's --node_id flag: killing its group by pid is losing the node."""
        for pid in self.started_processes():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if f"--node_id={node_id}" in argv and "raylet" in Path(argv[0]).name:
                role = self.node_of(pid)
                if role is not None:
                    return int((self.state_dir / f"{role}.pid").read_text())
        raise LookupError(f"no raylet of node {node_id} among the started processes")

    def started_processes(self) -> dict[int, float]:
        """pid -> create time of every live process the start scripts started: each node's `ray start --block`,
        its process group and descendants, and any process naming the temp dir the way Ray's processes do."""
        found: dict[int, float] = {}

        def add(p: psutil.Process) -> None:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found[p.pid] = p.create_time()
            except psutil.Error:
                pass

        leaders = [int(f.read_text()) for f in self.state_dir.glob("*.pid")]
        marks = (f"temp-dir={self.temp_dir}", f"temp_dir={self.temp_dir}", f"{self.temp_dir}/session_")
        for p in psutil.process_iter():
            try:
                in_group = os.getpgid(p.pid) in leaders
                named = any(m in arg for arg in p.cmdline() for m in marks)
            except (psutil.Error, ProcessLookupError):
                continue
            if in_group or named:
                add(p)
        for pid in leaders:
            try:
                leader = psutil.Process(pid)
            except psutil.Error:
                continue
            add(leader)
            for child in leader.children(recursive=True):
                add(child)
        return found

    def stop(self) -> tuple[subprocess.CompletedProcess, list[int]]:
        """stop.sh, and the pids of the processes started by the scripts that are still alive afterwards."""
        before = self.started_processes()
        result = run_script("stop.sh", "--temp-dir", str(self.temp_dir), "--grace", "20", timeout=90)
        left = []
        for pid, created in before.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.Error:
                pass
        return result, left


def start_cluster(
    head_gpus: int = 0,
    worker_gpus: tuple[int, ...] = (4,),
    cpus_per_node: int = 8,
    node_ip: str = NODE_IP,
    head_resources: dict | None = None,
    worker_resources: dict | None = None,
    worker_cpus: int | None = None,
) -> LocalCluster:
    """A head and one worker per entry of worker_gpus, started by the scripts in a fresh temp dir, waited for with
    wait.sh (every node alive, every declared GPU). `head_resources` / `worker_resources`: custom Ray resources the
    head / every worker declares (ray start --resources). On failure, whatever was started is stopped before
    raising. `worker_cpus`: the logical CPUs each worker declares (None: `cpus_per_node`, as the head)."""
    import json

    def extra(resources: dict | None) -> list[str]:
        return [f"--resources={json.dumps(resources)}"] if resources else []

    # Short and private: Ray's socket paths under TEMP/session_*/sockets must stay under the 107-byte limit.
    temp_dir = Path(tempfile.mkdtemp(prefix="fa-ray-", dir="/tmp"))
    head = ["--temp-dir", str(temp_dir), "--node-ip-address", node_ip, "--num-cpus", str(cpus_per_node)]
    try:
        # Every port free, so that this cluster can run next to another one on the machine (Ray's defaults are fixed).
        # Started from the temp dir, not the repository: a job must not depend on where its head was started.
        out = run_script(
            "start_head.sh", *head, "--num-gpus", str(head_gpus), "--port", str(free_port()),
            "--dashboard-port", str(free_port()), "--", f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", *extra(head_resources), cwd=temp_dir,
        )  # fmt: skip
        _check(out)
        values = dict(
            line.split("=", 1) for line in (temp_dir / "fully_async" / "cluster.env").read_text().split("\n") if line
        )
        worker = [*head[:-1], str(worker_cpus or cpus_per_node)]  # --num-cpus is the last of `head`'s flags
        for gpus in worker_gpus:
            out = run_script("start_worker.sh", *worker, "--num-gpus", str(gpus), "--",
                             f"--dashboard-agent-listen-port={free_port()}", *extra(worker_resources),
                             cwd=temp_dir)  # fmt: skip
            _check(out)
        nodes, total = 1 + len(worker_gpus), head_gpus + sum(worker_gpus)
        out = run_script("wait.sh", "--temp-dir", str(temp_dir), "--nodes", str(nodes), "--gpus", str(total),
                         "--timeout", "60")  # fmt: skip
        _check(out)
    except BaseException:
        try:
            run_script("stop.sh", "--temp-dir", str(temp_dir), "--grace", "10", timeout=60)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return LocalCluster(temp_dir, values["RAY_ADDRESS"], values["RAY_API_SERVER_ADDRESS"])


def _check(out: subprocess.CompletedProcess) -> None:
    """A start script that failed: its output (stdout and stderr together) in the error."""
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, out.args))} exited with {out.returncode}:\n{out.stdout}")


def node_tree(leader: int) -> list[int]:
    """`leader` and every live descendant of it (the processes of the node it started)."""
    try:
        root = psutil.Process(leader)
        return [root.pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []  # the node was killed already


def signal_all(pids: list[int], sig: int) -> None:
    """Send `sig` to each of `pids` (stop, continue or kill a node's processes, by the pids its start recorded)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, sig)
