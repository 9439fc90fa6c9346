"""The engine port's answering side: what the Rollouter actor answers about its engine pool, to the weight transports
(nodes, layout, rpc, reloads, weight groups, adapters), to `python -m fully_async.ctl engines` (the rows, add, remove)
and to its own stats (the pool's joins and leaves).

The Rollouter owns the pool's lifetime (it builds and starts it with its client) and hands the port out through one
actor method, `Rollouter.engine(call, *args)`, which runs `EngineService.call`: a call of the port, nothing else. The
calls are the methods of fully_async/weights/port.py's `EnginePort` (the asking side, typed; `CALLS` lists them),
each answered here by the method of the same name and parameters. So the engine package holds every rule about its
pool (engine.min_servers / max_servers, which servers a weight copy or a weight group spans, what a row of the
`engines` table says), a new transport call is one method here and one in EnginePort, and the Rollouter learns of a
sync only through `synced` (its staleness ledger and admission).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fully_async.aio import bounded
from fully_async.engines.slots import SlotState
from fully_async.weights.port import CALLS

logger = logging.getLogger(__name__)

ROW_STATE = {
    SlotState.SERVING: "serving",
    SlotState.STALE: "serving",
    SlotState.DOWN: "down",
    SlotState.RETIRED: "removed",
}
"""The `state` column of `fully_async.ctl engines`: a stale server is in rotation again at the next sync."""


class EngineService:
    """The engine port over `servers` (an `EngineServers`) and its `client`. `synced(version, serving)` is told of
    every completed weight sync: the servers hold `version` (`serving`: they serve it now, an adapter needs no
    resume; else from the resume on)."""

    def __init__(
        self, servers: Any, client: Any, tracer: Any = None, synced: Callable[[int, bool], None] | None = None
    ) -> None:
        self.servers = servers
        self.client = client
        self.tracer = tracer
        self.synced = synced or (lambda version, serving: None)
        self.joins = 0
        self.leaves = 0
        self.join_s: list[float] = []
        """Seconds each `add` took, from the call to every new server holding the current weights."""

    async def call(self, name: str, *args: Any) -> Any:
        """Port call `name` (one of weights/port.py's `CALLS`) with `args`, awaited when it is a coroutine."""
        if name not in CALLS:
            raise ValueError(f"the engine port has no call {name!r}; it answers {sorted(CALLS)}")
        result = getattr(self, name)(*args)
        return await result if asyncio.iscoroutine(result) else result

    # ---- weight transports -------------------------------------------------------------------------------------------
    def nodes(self) -> list[dict[str, Any]]:
        """Per engine server in the pool and not down: {"node_id", "node_ip", "host"} (its engine host's node and
        handle; a server that is a child of this process has this process's node and no host). The disk transport
        copies weights by it; one that is down (its node may be gone) gets its copy at the next sync after it is
        back."""
        import ray

        here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        out = []
        for i in self.servers.serving:
            server = self.servers.node_of(i)
            out.append(server if server["node_id"] is not None else {**server, "node_id": here})
        return out

    def layout(self) -> dict[str, Any]:
        """For the collective transport: the weight group's epoch and the servers a weight group spans now (not those
        the client holds down), each with its index, URL and worker count."""
        return self.servers.layout(self.servers.down)

    async def rpc(self, index: int, method: str, spec: str, timeout_s: float) -> list[Any]:
        """The weight receiver's `method(spec)` on every worker of server `index` (collective transport)."""
        return await self.servers.rpc(index, method, spec, timeout_s)

    def unverifiable(self) -> str:
        """Why weight syncs into these engines cannot be proven ("" = they can: weights/verify.py)."""
        return self.servers.kind.unverifiable

    def control_deadline_s(self) -> float:
        """engine.control_deadline_s: how long the disk transport waits on a node that stops answering in a copy."""
        return self.servers.cfg.control_deadline_s

    async def load_weights(
        self, weights_dir: str, version: int, node_dirs: dict[str, str | None] | None = None
    ) -> dict[str, Any] | None:
        """Every engine reloads `weights_dir` (servers on a node in `node_dirs`: that node's copy) as `version`,
        between the Rollouter's pause and resume; returns their answers to the reload (the disk transport's proof
        reads the digests in them). The port's layer of three `load_weights`: this one answers the transports and
        tells the Rollouter of the sync (`synced`); EngineServers.load_weights (pool.py) picks an adapter's resume
        or a reload; ControlPlane.load_weights (control.py) reloads every serving server under the membership
        lock."""
        answers = await self.servers.load_weights(weights_dir, version, node_dirs)
        self.synced(version, False)
        return answers

    async def weights_received(self, version: int, epoch: int) -> None:
        """Every server holds `version` (sent through a weight group formed at `epoch`): label it, no reload."""
        await self.servers.weights_received(version, epoch)
        self.synced(version, False)

    async def load_adapter(self, name: str, path: str, node_dirs: dict[str, str | None] | None = None) -> None:
        """Every engine loads the LoRA adapter in `path` (or its node's copy) as `name` (the adapter transport)."""
        await self.servers.weights.adapters.load(name, path, node_dirs)

    async def activate_adapter(self, name: str, version: int) -> None:
        """New requests name adapter `name`: the engines serve `version` from now on (no pause was needed)."""
        await self.servers.weights.adapters.activate(name, version)
        self.synced(version, True)

    async def unload_adapters(self) -> dict[str, list[str]]:
        """Unload the adapters no request names any more, beyond the newest kept (engines/adapters.py)."""
        return await self.servers.weights.adapters.unload()

    async def rpc_all(self, method: str, spec: str) -> dict[str, Any] | None:
        """The worker extension's `method(spec)` on every serving server at once, each within
        engine.control_deadline_s: {url: the workers' answers, or why the server gave none (a string)}; None when
        this engine kind has no worker extension to ask (`unverifiable` says why)."""
        if self.servers.kind.unverifiable:
            return None
        answers = await self.servers.control.rpc_all(method, spec)
        return {url: f"{type(a).__name__}: {a}" if isinstance(a, Exception) else a for url, a in answers.items()}

    # ---- fully_async.ctl engines -------------------------------------------------------------------------------------
    async def rows(self) -> list[dict[str, Any]]:
        """One row per server slot: index, url, state (serving, down, removed), requests in flight, seconds busy so
        far, and the Ray node it runs on (None for a child process of this one)."""
        servers, client = self.servers, self.client
        client.grow()
        busy = client.busy_seconds()
        nodes = await asyncio.gather(*(_node_id(p) for p in servers.procs))
        return [{"index": i, "url": proc.url, "state": ROW_STATE[servers.slots[i]], "in_flight": client.outstanding[i],
                 "busy_s": round(busy[i], 3), "node_id": nodes[i]}
                for i, proc in enumerate(servers.procs)]  # fmt: skip

    async def add(self, count: int = 1, max_servers: int | None = None) -> dict[str, Any]:
        """Start `count` more engine servers; each serves only once it holds the current weights and version.
        Refused (ValueError) past `max_servers` (default engine.max_servers; 0 = no limit)."""
        servers = self.servers
        max_servers = servers.cfg.max_servers if max_servers is None else max_servers
        live = len(servers.live)
        if count < 1:
            raise ValueError(f"add needs a count >= 1, got {count}")
        if max_servers and live + count > max_servers:
            raise ValueError(f"the pool has {live} servers; adding {count} passes engine.max_servers={max_servers}")
        start, wall = time.monotonic(), time.time()
        joined = await servers.add(count)
        took = time.monotonic() - start
        self.joins += len(joined)
        self.join_s.append(took)
        for i in joined:
            self._trace(f"engine/{i}", "join", wall, version=servers.state.version)
        logger.warning("engine pool: %d server(s) joined in %.1f s at version %d: %s", len(joined), took,
                       servers.state.version, [servers.address(i) for i in joined])  # fmt: skip
        return {"joined": [servers.address(i) for i in joined], "seconds": took, "live": len(servers.live)}

    async def remove(
        self, url: str, min_servers: int | None = None, drain_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Take the server at `url` out of the pool: no new requests; what it runs is aborted and continued on the
        others (restarted from the prompt with partial rollout off), within `drain_timeout_s` (default
        engine.control_timeout_s); then it is stopped and its resources freed. Refused (ValueError) below
        `min_servers` (default engine.min_servers)."""
        servers = self.servers
        min_servers = servers.cfg.min_servers if min_servers is None else min_servers
        drain_timeout_s = servers.cfg.control_timeout_s if drain_timeout_s is None else drain_timeout_s
        index = next((i for i in servers.live if servers.address(i) == url), None)
        if index is None:
            raise ValueError(f"no engine server at {url} in the pool: {[servers.address(i) for i in servers.live]}")
        if len(servers.live) - 1 < min_servers:
            raise ValueError(f"removing {url} leaves {len(servers.live) - 1} servers, below engine.min_servers="
                             f"{min_servers}")  # fmt: skip
        wall = time.time()
        moved = await self.client.remove_server(index, drain_timeout_s)
        self.leaves += 1
        self._trace(f"engine/{index}", "leave", wall, moved=moved)
        logger.warning("engine pool: %s removed; %d request(s) continued on the others", url, moved)
        return {"removed": url, "moved": moved, "live": len(servers.live)}

    def stats(self) -> dict[str, Any]:
        """The pool's size and changes so far (the Rollouter's `pool` stats). `size` counts the servers that serve
        (in the pool and not down: the N of the rollouter idle ratio), `down` those waiting for a restart or a
        replacement; `size + down` is the pool's membership."""
        servers = self.servers
        replacements = sum(1 for e in servers.pool_events if e[0] == "replace")
        return {"size": len(servers.serving), "down": len(servers.down), "joins": self.joins, "leaves": self.leaves,
                "replacements": replacements, "restarts": self.client.stats.restarts, "join_s": list(self.join_s),
                "moved": self.client.stats.moved}  # fmt: skip

    def _trace(self, lane: str, name: str, start: float, **fields: Any) -> None:
        if self.tracer is not None:
            self.tracer.record(lane, name, start, time.time(), **fields)


async def _node_id(proc: Any) -> str | None:
    """The Ray node of a server's engine host; None for a child process, or when the host (or its node) is gone: the
    state column says which."""
    if getattr(proc, "host", None) is None:
        return None
    try:
        return (await bounded(proc.host.where.remote(), 10))["node_id"]
    except Exception:  # the host (or its node) is gone: that is what the state column says
        return None
