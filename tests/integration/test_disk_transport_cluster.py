"""The disk transport on the 2-node loopback cluster (tests/local_cluster.py): a driver on the head runs ParamSync (sim
backend) against engine servers owned by EngineHost actors on the worker node (real `python -m tests.fakes`
processes, which reload a directory and shift their outputs by the weights in it), and against one on the head.

- two servers on the worker: one node-local copy per version (listed under /dev/shm), written once (the hosts'
  write counters), older versions pruned; both reload the copy (the source is overwritten after the copy and the
  servers still show the copied weights), label the version, and a restarted server reloads the copy;
- a copy that fails names the node;
- servers on the driver's node only: nothing is copied, the servers reload the export itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.local_cluster import REPO, script_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_DRIVER = r"""
import asyncio, json, os, shutil
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fully_async.config import AlgorithmConfig, EngineConfig, FullyAsyncConfig, SimTrainerConfig, TrainerConfig
from fully_async.engines import EngineClient
from fully_async.engines.host import EngineHost
from fully_async.engines.service import EngineService
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync, ParamSyncError
from fully_async.rollouter import Rollouter
from fully_async.training.sim_backend import SimBackend
from fully_async.weights.disk import DiskTransport, node_root
from tests.fakes import FakeProcessServers
from tests.hung_node import close_run

ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
here = ray.get_runtime_context().get_node_id()
(worker,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
run_dir = Path(os.environ["RUN_DIR"])
out = {"here": here, "worker": worker}


class Pool:
    # The Rollouter's weight-sync surface over a real engine pool: its own engine port, unchanged.
    engine = Rollouter.engine

    def __init__(self, servers):
        self.servers = servers
        self.cfg = FullyAsyncConfig(engine=servers.cfg)
        self.engine_service = EngineService(servers, None)

    async def pause(self):
        await self.servers.pause("abort")

    async def resume(self):
        await self.servers.resume()



def hosts_on(node, count, tag):
    strategy = NodeAffinitySchedulingStrategy(node, soft=False)
    return [ray.remote(EngineHost).options(num_cpus=0, max_concurrency=8, scheduling_strategy=strategy)
            .remote(f"{tag}-{i}", str(run_dir / f"{tag}-{i}.log"), "127.0.0.1", node) for i in range(count)]


async def outputs(servers, version):
    client = EngineClient(servers)
    try:
        results = []
        for i in range(len(servers.procs)):
            client.outstanding[:] = [0 if j == i else 1 for j in range(len(servers.procs))]
            r = await client.generate([1, 2], 3)
            assert r.servers == [servers.addresses[i]] and r.versions == [version] * 3, (r.servers, r.versions)
            results.append([int(t) for t in r.token_ids])
        return results
    finally:
        await client.close()


def run(tag, node, count):
    backend = SimBackend(TrainerConfig(backend="sim", sim=SimTrainerConfig(time_scale=1e4)), AlgorithmConfig())
    hosts = hosts_on(node, count, tag)
    servers = FakeProcessServers(EngineConfig(startup_timeout_s=60.0), run_dir, run_dir, hosts=hosts)
    servers.start()
    handle = LocalActor(Pool(servers))
    root = run_dir / f"{tag}-weights"
    transport = DiskTransport(handle, backend, root, "float32")
    sync = ParamSync(handle, backend, root, "float32", 120.0, transport=transport)
    res = {"outputs": [asyncio.run(outputs(servers, 0))], "timings": [], "node_dirs": []}
    try:
        for version in (1, 2, 3):
            backend.step = 10 * version  # what the sim backend exports: the engines shift their tokens by it
            res["timings"].append(sync.sync(version))
            res["node_dirs"].append(dict(transport.node_dirs))
            res["outputs"].append(asyncio.run(outputs(servers, version)))
        name = transport.node_root_name(node)
        res["listing"] = sorted(p.name for p in node_root(name).glob("v*")) if node_root(name).exists() else None
        res["roots"] = sorted(p.name for p in Path("/dev/shm").glob(f"fully_async-weights-{transport.run_tag}-*"))
        # The servers read their node's copy: overwrite the export after the copy; the reload must not see it.
        backend.step = 40
        plan = transport.plan(4, background=False)
        for name_, fn in plan.reads + plan.ahead + plan.engines:
            fn()
            if name_ == "distribute" and transport.node_dirs:
                (root / "v4" / "sim_weights.json").write_text(json.dumps({"step": 999}))
        res["outputs"].append(asyncio.run(outputs(servers, 4)))
        servers.restart(count - 1)
        res["after_restart"] = asyncio.run(outputs(servers, 4))
        res["writes"] = [w["weight_writes"] for w in ray.get([h.where.remote() for h in hosts])]
        if transport.node_dirs:  # a node whose copy fails: its root's path is taken by a file
            shutil.rmtree(node_root(transport.node_root_name(node)))
            node_root(transport.node_root_name(node)).write_text("in the way")
            try:
                sync.sync(5)
            except ParamSyncError as e:
                res["failure"] = str(e)
            node_root(transport.node_root_name(node)).unlink()
    finally:
        res["roots_after_close"] = close_run(sync, handle, servers, hosts)
    return res


out["remote"] = run("w", worker, 2)
out["local"] = run("h", here, 1)
print("RESULT " + json.dumps(out))
"""


def test_disk_transport_copies_once_per_other_node_and_the_engines_there_load_the_copy(two_node_cluster, tmp_path):
    env = script_env(RAY_ADDRESS=two_node_cluster.gcs_address, RUN_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _DRIVER], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=500)  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(line.removeprefix("RESULT "))
    remote, local = out["remote"], out["local"]

    # Two servers on the worker: one copy per version there, written by one host, the older ones pruned.
    assert remote["writes"] == [4, 0]  # syncs 1-4, each written once for the node's two servers
    assert remote["listing"] == ["v2", "v3"] and len(remote["roots"]) == 1
    for version, dirs in enumerate(remote["node_dirs"], 1):
        assert list(dirs) == [out["worker"]] and dirs[out["worker"]].endswith(f"-node-{out['worker'][:12]}/v{version}")
    assert all("timing_s/param_sync/distribute" in t for t in remote["timings"])
    # Outputs follow the weights (tokens shift by the exported step), labelled with the version.
    base = remote["outputs"][0][0]
    for version, per_server in enumerate(remote["outputs"]):
        assert per_server == [[(t + 10 * version) % 250 for t in base]] * 2
    assert remote["after_restart"] == remote["outputs"][4]  # the restarted server reloaded the node's copy
    assert "phase 'distribute' failed" in remote["failure"] and out["worker"] in remote["failure"]
    assert remote["roots_after_close"] == []

    # Servers on the driver's node only: no copy, the servers reload the export itself (so they saw step 40).
    assert local["writes"] == [0] and local["roots"] == [] and local["listing"] is None
    assert all(d == {} for d in local["node_dirs"])
    assert local["outputs"][4] == [[(t + 40) % 250 for t in local["outputs"][0][0]]]
