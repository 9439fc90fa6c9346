"""A weight sync that meets a hung engine node, measured: the driver of tests/integration/test_hung_node.py and of
scripts/bench/hung_node.py (which also runs it on older code, to compare).

Run as a Ray driver on the head of a loopback cluster (tests/local_cluster.py) whose one worker node's `ray start --block`
process has pid HUNG_LEADER: two engine servers (`python -m tests.fakes` processes under EngineHost actors, one on
the head, one on the worker), a sim backend, the real ParamSync and disk transport. The worker node is "hung" by
SIGSTOP of that process and every descendant of it (its raylet, its Ray workers, the engine host and its server),
found from that pid only. Scenarios (SCENARIOS, in order, comma separated):

- before: the node stops between two syncs; the next sync meets it at its pause.
- during: the node stops after the pause, before the copy to its node; the sync meets it in the copy and reload.

Between scenarios the node continues (SIGCONT) and its server is restarted in place. After the last one, with the
node still stopped, one more sync (`after_s`) and a generation on the live server show that the run goes on. Prints
one line `RESULT {json}`: per scenario the trainer's blocked time (timing_s/param_sync: pause to resume) and phases.

Environment: RAY_ADDRESS, RUN_DIR, HUNG_LEADER, SCENARIOS (default before,during), DEADLINE_S (engine.
control_deadline_s, where the code has it), CONTROL_TIMEOUT_S (engine.control_timeout_s), SYNC_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fully_async.config import AlgorithmConfig, EngineConfig, SimTrainerConfig, TrainerConfig
from fully_async.engines import EngineClient
from fully_async.engines.host import EngineHost
from fully_async.engines.service import EngineService
from fully_async.handles import LocalActor
from fully_async.training.sim_backend import SimBackend
from fully_async.weights.base import SyncPlan
from fully_async.weights.disk import ROOT_PREFIX, DiskTransport
from tests.fakes import EnginePortByName, FakeProcessServers

try:  # scripts/bench/hung_node.py also runs this driver on older code: before ParamSync moved into sync/ and the
    # loopback cluster out of the package
    from fully_async.sync import ParamSync
    from tests.local_cluster import node_tree, signal_all
except ImportError:
    from fully_async.local_cluster import node_tree, signal_all
    from fully_async.param_sync import ParamSync


class Node:
    """The worker node, stopped and continued by pid."""

    def __init__(self, leader: int) -> None:
        self.leader = leader
        self.stopped: list[int] = []

    def stop(self) -> None:
        self.stopped = node_tree(self.leader)
        signal_all(self.stopped, signal.SIGSTOP)

    def cont(self) -> None:
        signal_all(self.stopped, signal.SIGCONT)
        self.stopped = []


class Pool(EnginePortByName):
    """The Rollouter's weight-sync surface over a real engine pool (EngineService's nodes, as the Rollouter's)."""

    def __init__(self, servers, deadline_s: float) -> None:
        self.servers = servers
        self.service = EngineService(servers, None)
        self.deadline_s = deadline_s

    async def pause(self) -> None:
        await self.servers.pause("abort")

    async def resume(self) -> None:
        await self.servers.resume()

    async def load_weights(self, weights_dir, version, node_dirs=None) -> None:
        await self.servers.load_weights(weights_dir, version, node_dirs)

    def nodes(self):
        return self.service.nodes()

    async def rpc_all(self, method: str, spec: str):
        return await self.service.rpc_all(method, spec)

    def unverifiable(self) -> str:
        return self.servers.kind.unverifiable

    def control_deadline_s(self) -> float:
        return self.deadline_s


class StoppingTransport(DiskTransport):
    """The disk transport, whose next sync may stop the node first (right after ParamSync's pause)."""

    node: Node
    stop_next = False

    def plan(self, version: int, background: bool) -> SyncPlan:
        plan = super().plan(version, background)
        if self.stop_next:
            self.stop_next = False
            return dataclasses.replace(plan, engines=(("stop node", self.node.stop), *plan.engines))
        return plan


async def generate(servers, index: int) -> dict:
    """One request on server `index` (the others held busy so the balancer picks it)."""
    on_dead = servers.on_dead
    client = EngineClient(servers)
    try:
        client.outstanding[:] = [0 if j == index else 1 for j in range(len(servers.procs))]
        r = await client.generate([1, 2], 3)
        return {"server": r.servers, "versions": r.versions}
    finally:
        await client.close()
        servers.on_dead = on_dead


def fake_state(url: str) -> dict:
    """The fake engine's record at `url` (its version label and the directories it reloaded)."""
    import urllib.request

    with urllib.request.urlopen(url + "/fake_state", timeout=30) as resp:
        return json.loads(resp.read())


def close_run(sync, handle, servers, hosts) -> list[str]:
    """Close a driver's run: the sync (which removes its node-local weight roots), the rollouter stand-in, the servers
    and their engine hosts. Returns the names of the run's weight roots still in /dev/shm."""
    sync.close()
    left = sorted(p.name for p in Path("/dev/shm").glob(f"{ROOT_PREFIX}{sync.transport.run_tag}-*"))
    handle.close()
    servers.stop()
    for host in hosts:
        ray.kill(host)
    return left


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
    run_dir = Path(os.environ["RUN_DIR"])
    deadline_s = float(os.environ.get("DEADLINE_S", "10"))
    scenarios = os.environ.get("SCENARIOS", "before,during").split(",")
    here = ray.get_runtime_context().get_node_id()
    (worker,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    hosts = [
        ray.remote(EngineHost)
        .options(num_cpus=0, max_concurrency=8, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        .remote(f"engine-{i}", str(run_dir / f"engine-{i}.log"), "127.0.0.1", node)
        for i, node in enumerate([here, worker])
    ]
    cfg = {"startup_timeout_s": 60.0, "control_timeout_s": float(os.environ.get("CONTROL_TIMEOUT_S", "60"))}
    if "control_deadline_s" in {f.name for f in dataclasses.fields(EngineConfig)}:  # older code has no such key
        cfg["control_deadline_s"] = deadline_s
    servers = FakeProcessServers(EngineConfig(**cfg), run_dir, run_dir, hosts=hosts)
    servers.start()
    handed: list[int] = []
    servers.on_dead = handed.append  # the client's restart policy is tested apart; here: who was handed over
    handle = LocalActor(Pool(servers, deadline_s))
    backend = SimBackend(TrainerConfig(backend="sim", sim=SimTrainerConfig(time_scale=1e4)), AlgorithmConfig())
    node = Node(int(os.environ["HUNG_LEADER"]))
    transport = StoppingTransport(handle, backend, run_dir / "weights", "float32")
    transport.node = node
    sync = ParamSync(handle, backend, run_dir / "weights", "float32", float(os.environ.get("SYNC_TIMEOUT_S", "300")),
                     transport=transport)  # fmt: skip
    out: dict = {"worker": worker, "deadline_s": deadline_s, "warm": sync.sync(1)["timing_s/param_sync"]}
    version = 1
    try:
        for k, scenario in enumerate(scenarios):
            version += 1
            if scenario == "before":
                node.stop()
            else:
                transport.stop_next = True
            timings = sync.sync(version)
            out[scenario] = {"blocked_s": timings["timing_s/param_sync"], "phases": timings, "handed": list(handed),
                             "serving": servers.serving, "node_dirs": dict(transport.node_dirs)}  # fmt: skip
            if k < len(scenarios) - 1:  # the node continues; its server restarts in place before the next scenario
                node.cont()
                servers.restart(1)
                handed.clear()
                out["worker_at_restart"] = fake_state(servers.address(1))
        version += 1
        start = time.monotonic()
        sync.sync(version)  # the node still stopped: its server is down and not called
        out["after_s"] = time.monotonic() - start
        out["after_generate"] = asyncio.run(generate(servers, 0))
        out["version"] = version
    finally:
        node.cont()  # so that the close below finds the node's host answering
        # What reached the worker's server since its last restart: a call sent while it was stopped waits in its
        # socket and is served now, before this question, which queues behind it.
        time.sleep(1.0)
        out["worker_at_end"] = fake_state(servers.address(1))
        out["roots_after_close"] = close_run(sync, handle, servers, hosts)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
