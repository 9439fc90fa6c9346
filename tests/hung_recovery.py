"""An engine node that hangs (or dies) and its server coming back, measured: the driver of
tests/integration/test_hung_node_recovery.py and of scripts/bench/hung_recovery.py.

Run as a Ray driver on the head of a loopback cluster (tests/local_cluster.py) whose one worker node's `ray start --block`
process has pid HUNG_LEADER: two engine servers (`python -m tests.fakes` processes under EngineHost actors, one on
the head, one on the worker), the job's HostFactory for replacements (one-bundle placement groups, on whatever node
has room: here the head), a real EngineClient (its recovery restarts or replaces what a sync sets aside). SCENARIO:

- stop: every process of the worker node is stopped (SIGSTOP); a sync meets it and sets its server aside; the
  server is replaced once Ray declares the node dead or after engine.hung_host_s (HUNG_HOST_S);
- stop-cont: the same, and the node continues (SIGCONT) CONT_AFTER_S seconds after the stop, before
  engine.hung_host_s: the server is restarted in place;
- kill: every process of the worker node is killed (SIGKILL): the server is replaced.

After the stop, the run goes on: generations on the head's server, and a second sync. Prints one line
`RESULT {json}`: per scenario (SCENARIOS, comma separated, in order, each on a fresh pool; the node continues
between them, so `kill` goes last) the seconds from the stop (or kill) to the server serving again (its first
generation at the current version), whether it moved, and the pool's events, counts and versions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fully_async.config import compose
from fully_async.engines import EngineClient
from fully_async.engines.host import EngineHost, HostFactory
from fully_async.engines.slots import SlotState
from tests.fakes import FakeProcessServers
from tests.hung_node import Node
from tests.local_cluster import node_tree, signal_all


async def _sync(servers, weights: Path, version: int) -> None:
    await servers.pause("abort")
    await servers.load_weights(weights, version)
    await servers.resume()


async def _generate_on(client, servers, index: int) -> dict:
    client.outstanding[:] = [0 if j == index else 1 for j in range(len(servers.procs))]
    r = await client.generate([1, 2], 3)
    return {"servers": r.servers, "versions": r.versions}


async def scenario(servers, node: Node, name: str, cont_after_s: float, weights: Path) -> dict:
    client = EngineClient(servers, auto_restart=True)
    await _sync(servers, weights, 1)
    old_url = servers.address(1)
    start = time.monotonic()
    if name == "kill":
        signal_all(node_tree(node.leader), signal.SIGKILL)
    else:
        node.stop()
    await _sync(servers, weights, 2)  # meets the node: its server is set aside, the sync goes on with the head's
    out: dict = {"down_after_sync": sorted(servers.down), "serving_after_sync": servers.serving}
    out["head_generate"] = await _generate_on(client, servers, 0)  # the run goes on meanwhile
    if name == "stop-cont":
        await asyncio.sleep(max(0.0, cont_after_s - (time.monotonic() - start)))
        node.cont()
    while servers.slots[1] is not SlotState.SERVING:
        await asyncio.sleep(0.1)
    out["back_s"] = time.monotonic() - start
    out["back_generate"] = await _generate_on(client, servers, 1)
    out["stop_to_serving_s"] = time.monotonic() - start
    await _sync(servers, weights, 3)  # the pool at full size again takes the next sync
    out["last_generate"] = await _generate_on(client, servers, 1)
    out.update(moved=servers.address(1) != old_url, old_url=old_url, url=servers.address(1),
               events=servers.pool_events, restarts=client.stats.restarts, failed_tries=client.recovery.failed_tries,
               serving=servers.serving, node_of_1=servers.node_of(1)["node_id"])  # fmt: skip
    await client.close()
    return out


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
    run_dir = Path(os.environ["RUN_DIR"])
    here = ray.get_runtime_context().get_node_id()
    (worker,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    node = Node(int(os.environ["HUNG_LEADER"]))
    results = {}
    for k, name in enumerate(os.environ["SCENARIOS"].split(",")):
        results[name] = one(run_dir / f"{k}-{name}", name, here, worker, node)
    print("RESULT " + json.dumps({"worker": worker, "head": here, **results}), flush=True)


def one(run_dir: Path, name: str, here: str, worker: str, node: Node) -> dict:
    """One scenario on a fresh pool (a server on each node); the node continues at its end."""
    cfg = compose([f"engine.control_deadline_s={os.environ.get('DEADLINE_S', '3')}",
                   f"engine.hung_host_s={os.environ.get('HUNG_HOST_S', '120')}", "engine.replace_retry_s=2",
                   "engine.startup_timeout_s=60", "placement.engine_cpus=0.01", "placement.timeout_s=30"])  # fmt: skip
    weights = run_dir / "weights"
    weights.mkdir(parents=True)
    hosts = [
        ray.remote(EngineHost)
        .options(num_cpus=0, max_concurrency=8, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
        .remote(f"engine-{i}", str(run_dir / f"engine-{i}.log"), "127.0.0.1", here)
        for i, n in enumerate([here, worker])
    ]
    servers = FakeProcessServers(cfg.engine, run_dir, run_dir, hosts=hosts)
    servers.host_factory = HostFactory(cfg, str(run_dir), here, None, None, gpu=False)
    servers.start()
    try:
        out = asyncio.run(scenario(servers, node, name, float(os.environ.get("CONT_AFTER_S", "10")), weights))
        out.update(deadline_s=cfg.engine.control_deadline_s, hung_host_s=cfg.engine.hung_host_s)
    finally:
        node.cont()
        servers.stop()
        for host in hosts:
            ray.kill(host)
    return out


if __name__ == "__main__":
    main()
