"""The engine pool: N servers of one kind, their lifecycle (start, stop, restart, relaunch, replace), membership and
elastic changes (add, remove), one state per server slot (slots.py), and the router's worker list. What the servers
must load before they serve (the latest weights' directory and node copies, the adapters, the weight group's epoch)
is one object the pool holds, `weights` (served.py).

An `EngineServers` owns its server processes (children of this process, or each under an `EngineHost` actor on its
node, or attached by address) and drives all of them at once through its `ControlPlane` (control.py). It holds one
engine kind (`kind`, an `EngineKind` of base.py: vllm.py, sglang.py, sim.py) that says how to launch, address and
control one server; `EngineClient` (client.py) sends generate requests to the servers and tells the pool which ones
died (`server_died`) or leave (`retire`).

Versions: `state.version` is the number of completed weight syncs whose weights the serving servers hold. A server
that joins or comes back gets the current weights (`weights`) and version before it serves (under `membership`, the
lock a sync's reload and version also hold), or waits out of rotation as STALE when those weights exist in no
directory. `weights.epoch` changes whenever the servers' workers change (a restart, a join, a node without a weights
copy): a weight group formed at an older epoch must be re-formed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fully_async.aio import NamedLock, bounded
from fully_async.config import EngineConfig
from fully_async.engines import lifecycle
from fully_async.engines.adapters import Adapters
from fully_async.engines.base import EngineKind
from fully_async.engines.control import ControlPlane
from fully_async.engines.elastic import join, leave, relaunch
from fully_async.engines.errors import EngineError
from fully_async.engines.lifecycle import server_process
from fully_async.engines.process import ServerProcess, node_of
from fully_async.engines.served import ServedWeights
from fully_async.engines.slots import Slots, SlotState
from fully_async.engines.types import EngineState, PauseMode
from fully_async.engines.warmup import WarmupPlan
from fully_async.handles import dead_nodes

logger = logging.getLogger(__name__)


def membership_wait_s(cfg: Any) -> float:
    """How long a change of the pool waits for its membership lock: what one holder may legitimately take, a reload
    (engine.control_timeout_s) and three pool-wide calls after it (engine.control_deadline_s each: version, pause,
    prefix cache). Below advanced.sync_timeout_s at the defaults (90 s against 300 s), so a stuck holder fails the
    sync naming itself before the sync's own bound fires."""
    return cfg.control_timeout_s + 3 * cfg.control_deadline_s


class EngineServers:
    """A pool of engine servers of one kind (see the module docstring)."""

    def __init__(
        self,
        kind: EngineKind,
        run_dir: str | Path,
        addresses: list[str] | None = None,
        hosts: list[Any] | None = None,
    ):
        """kind: how to launch, address and control one server (its config, model, device and LoRA serving);
        addresses: attach to servers already running there (nothing is launched, restart is impossible);
        hosts: one `EngineHost` actor per server (engines/host.py), placed by the job: each server runs on its
        host's node; neither: the servers are child processes of this one. vLLM servers always load the weight
        receiver (the worker extension every reload goes through, whatever the transport)."""
        self.kind = kind
        self.cfg: EngineConfig = kind.cfg
        self.model_path = kind.model_path
        self.run_dir = Path(run_dir)
        self.device = kind.device
        self.state = EngineState()
        """The version and pause state the control plane and the clients of this process share (types.py): the pool's,
        not `weights`'s, since every request reads the version beside the pause; `weights` reads it from here."""
        adapters = Adapters(self, kind.lora) if kind.lora is not None else None
        self.weights = ServedWeights(self.state, adapters)
        """What a server that joins or comes back loads before it serves (served.py): the latest weights' directory
        and node copies, the adapters, the weight group's epoch."""
        self.hosts = hosts
        self.host_factory: Any = None
        """Makes engine hosts for servers added or replaced while the run goes on (`create(index)`, `release(host)`);
        set by the rollouter when the job placed the servers through Ray."""
        self.warmup: WarmupPlan | None = None
        """Throw-away requests each server answers after it starts (or restarts, or joins) and before it serves
        (engines/warmup.py); None: none. Set by the rollouter from the run's prompts."""
        self.started_at: dict[str, tuple[float, float]] = {}
        """Wall-clock (start, end) of `start`'s parts: `engine_launch` (from `launch` to every server healthy and
        current), `engine_warmup` (the start-up's record, fully_async/startup.py)."""
        self.on_dead: Any = None
        """Called with the index of a server a control call found dead (the client schedules its restart)."""
        self._membership: NamedLock | None = None
        self._growing_lock: asyncio.Lock | None = None
        self.pool_events: list[tuple[str, int, str, str | None]] = []
        """(event, index, url, new url) for joins, leaves and replacements, in order (the rollouter's metrics)."""
        self.closed = False
        """Set by `stop`: a recovery still waiting for a hung host gives up."""
        self.router: Any = None
        """A router process in front of the servers (engine.router; `make_router`), started and stopped with the pool:
        generation goes through it, control calls still go to each server. Its worker list follows the pool."""
        if addresses is not None:
            self.procs = [ServerProcess.external(url) for url in addresses]
        else:
            count = len(hosts) if hosts is not None else self.cfg.num_servers
            self.procs = [self.new_process(i) for i in range(count)]
        self.slots = Slots(len(self.procs))
        control = kind.control_class or ControlPlane  # engine=sim delivers the same calls in process
        self.control: ControlPlane = control(self, self.cfg.control_deadline_s, self.cfg.control_timeout_s)

    # ---- slots -------------------------------------------------------------------------------------------------------
    @property
    def live(self) -> list[int]:
        """Indices of the servers in the pool (not removed)."""
        return self.slots.indices(SlotState.SERVING, SlotState.DOWN, SlotState.STALE)

    @property
    def serving(self) -> list[int]:
        """Servers in the pool and not down: pool-wide control calls go to these (stale ones too: the next sync must
        reach them); one that comes back gets the current weights and version before it serves
        (`elastic.bring_current`)."""
        return self.slots.indices(SlotState.SERVING, SlotState.STALE)

    @property
    def down(self) -> frozenset[int]:
        """Servers whose process died, being restarted or replaced (a snapshot of the slots)."""
        return self.slots.of(SlotState.DOWN)

    @property
    def stale(self) -> frozenset[int]:
        """Servers on weights older than the current version, out of rotation until the next sync reaches them."""
        return self.slots.of(SlotState.STALE)

    @property
    def retired(self) -> frozenset[int]:
        """Servers removed from the pool; slots are never reused, so indices stay stable."""
        return self.slots.of(SlotState.RETIRED)

    def server_died(self, index: int) -> None:
        """Server `index` is gone: out of rotation and of pool-wide calls, handed to `on_dead` (the client restarts
        or replaces it)."""
        self.slots.mark_down(index)
        if self.on_dead is not None:
            self.on_dead(index)

    def retire(self, index: int) -> None:
        """Server `index` takes no new request from now on (the first step of `remove`)."""
        self.slots.retire(index)

    # ---- addresses, logs, router -------------------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [p.url for p in self.procs]

    def address(self, index: int) -> str:
        """URL of server `index`; O(1), for per-request paths (`addresses` builds the whole list)."""
        return self.procs[index].url

    def generate_url(self, index: int) -> str:
        """Where a generate request the client accounts to server `index` goes: the router when there is one (which
        then picks the server), else server `index` itself."""
        return self.router.url if self.router is not None else self.procs[index].url

    def log_tail(self, index: int, lines: int = 40) -> str:
        """The last lines of server `index`'s log, read on its node."""
        return self.procs[index].tail(lines)

    def log_path(self, index: int) -> Path | None:
        return self.procs[index].log_path

    def log_for(self, url: str) -> str:
        if self.kind.in_process:
            return "emulated engine, no log"
        if self.router is not None and url == self.router.url:
            return str(self.router.proc.log_path)
        for p in self.procs:
            if p.url == url:
                return str(p.log_path) if p.log_path else "external server, no log here"
        return "unknown server"

    def is_alive(self, index: int) -> bool:
        return self.procs[index].is_alive()

    def on_lost_nodes(self, indices: list[int]) -> list[int]:
        """Of servers `indices`, those on a Ray node that Ray reports dead (a pool-wide control call sets them aside
        without calling them). Blocking (one question to Ray's node table, only when some server has a Ray node):
        call it in a thread."""
        nodes = {i: self.procs[i].node["node_id"] for i in indices if hasattr(self.procs[i], "node")}
        if not nodes:
            return []
        dead = dead_nodes()
        return [i for i, node in nodes.items() if node in dead]

    def node_of(self, index: int) -> dict[str, Any]:
        """{"node_id", "node_ip", "host"} of server `index`: its engine host's node and handle; for a server that
        is a child of this process (or attached by address), node_id is None: this process's node."""
        return node_of(self.procs[index])

    def routed_urls(self) -> list[str]:
        """The servers a router may send requests to: the serving ones (not removed, down or stale)."""
        return [self.procs[i].url for i in self.slots.indices(SlotState.SERVING)]

    def sync_router(self) -> None:
        """Make the router's worker list follow the pool (no-op without a router). Blocking: call it in a thread."""
        if self.router is not None:
            self.router.sync(self.routed_urls(), self.cfg.control_timeout_s)

    async def sync_router_async(self) -> None:
        """`sync_router` from the event loop; a failure is logged (the router's own health checks still skip a dead
        server, and the next membership change syncs again)."""
        if self.router is None:
            return
        bound_s = self.cfg.control_timeout_s + self.cfg.control_deadline_s  # the router's own calls take timeout_s
        try:
            await bounded(asyncio.to_thread(self.sync_router), bound_s)
        except EngineError as e:
            logger.warning("router worker list not updated: %s", e)
        except TimeoutError:
            logger.warning("router worker list not updated: no answer within %g s (the call goes on in its thread)",
                           bound_s)  # fmt: skip

    def restart_router(self) -> None:
        """Start a router that died again, over the servers that may serve now (a new port). Blocking."""
        if self.router is not None and not self.router.is_alive():
            logger.error("the engine router died (log %s); restarting it", self.router.proc.log_path)
            self.router.restart(self.routed_urls(), self.cfg.startup_timeout_s)

    # ---- control plane (control.py), as the pool's own calls ---------------------------------------------------------
    @property
    def membership(self) -> NamedLock:
        """Held while the pool's members or their weights change (a sync's reload and version, a join, a rejoin), so a
        server never joins with weights older than the version it is labelled with. Waited for at most
        `membership_wait_s`: a holder that hangs fails the waiter naming itself instead of stalling a sync."""
        if self._membership is None:
            self._membership = NamedLock("the engine pool's membership lock", membership_wait_s(self.cfg))
        return self._membership

    async def pause(self, mode: PauseMode = "abort", idle: Callable[[], bool] | None = None) -> bool:
        """Hold the clients and pause the servers, unless `idle` says nothing is in flight (control.py `pause`);
        returns whether the servers were paused."""
        return await self.control.pause(mode, idle)

    async def resume(self) -> None:
        await self.control.resume()

    async def set_version(self, version: int) -> None:
        async with self.membership:
            await self.control.set_version(version)

    async def reset_prefix_cache(self) -> None:
        await self.control.reset_prefix_cache()

    async def is_paused(self, url: str) -> bool:
        return await self.control.is_paused(url)

    async def rpc(self, index: int, method: str, spec: str, timeout_s: float) -> list[Any]:
        """`method(spec)` on every worker of server `index`; the workers' answers."""
        return await self.control.rpc(self.procs[index].url, method, spec, timeout_s)

    # ---- weights (control.py) ----------------------------------------------------------------------------------------
    async def load_weights(
        self, weights_dir: str | Path, version: int, node_dirs: dict[str, str | None] | None = None
    ) -> dict[str, Any] | None:
        """Reload weights from a directory of safetensors (checkpoint names) on every server, then set the version.
        `node_dirs`: Ray node id -> a copy of that directory on that node, which the node's servers reload instead;
        None for a node whose copy was abandoned (its servers are set aside, control.py). Call between pause and
        resume. With adapters, a directory that holds one (a resumed run's first weights) is loaded and activated as
        the adapter of `version` beside the base model instead. Returns the servers' answers to the reload
        (control.py `load_weights`; None for an adapter). The middle one of three `load_weights`: the engine port's
        (service.py: a transport's call, which also tells the Rollouter of the sync) calls this one, which chooses
        between an adapter and a reload; ControlPlane.load_weights (control.py) runs the reload on the servers."""
        adapters = self.weights.adapters
        if adapters is not None and (Path(weights_dir) / "adapter_config.json").is_file():
            await adapters.resume(weights_dir, version, node_dirs)
            return None
        return await self.control.load_weights(weights_dir, version, node_dirs)

    async def weights_received(self, version: int, epoch: int) -> None:
        """Every server received `version` through a weight group formed at `epoch` (collective transport): reset
        prefix caches and set the version, without a reload. Servers restarted since (a newer epoch) stay stale."""
        await self.control.weights_received(version, epoch)

    def layout(self, down: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        """For the collective transport: the weight group's epoch (`weights.epoch`) and the servers it spans now (all
        in the pool but `down`), each with its index, URL and worker count."""
        servers = [{"index": i, "url": self.procs[i].url, "workers": self.kind.workers_per_server}
                   for i in self.live if i not in down]  # fmt: skip
        return {"epoch": self.weights.epoch, "servers": servers}

    # ---- lifecycle ---------------------------------------------------------------------------------------------------
    def new_process(self, index: int, port: int | None = None, host: Any = None) -> ServerProcess:
        """Server `index` as a process (lifecycle.py `server_process`), under its placed engine host if it has one."""
        if host is None and self.hosts is not None and index < len(self.hosts):
            host = self.hosts[index]
        return server_process(self.kind, self.run_dir, index, host, port)

    def launch(self) -> None:
        """Launch every server without waiting for it; `start` then waits (lifecycle.py)."""
        lifecycle.launch(self)

    def start(self) -> None:
        """Launch every server (unless `launch` did) and block until all are healthy (EngineError with the log tail
        otherwise)."""
        lifecycle.start(self)

    def stop(self) -> None:
        """Stop every launched server and free the hosts made for added or replaced ones; safe to call twice."""
        lifecycle.stop(self)

    def restart(self, index: int) -> None:
        """Restart server `index` with the latest weights and version (lifecycle.py). Blocks until healthy."""
        lifecycle.restart(self, index)

    async def restart_async(self, index: int) -> None:
        """`restart` from the event loop that runs the control plane (lifecycle.py)."""
        await lifecycle.restart_async(self, index)

    def relaunch(self, index: int) -> None:
        """Start server `index` again and wait until healthy, in place or on a new host (`elastic.relaunch`)."""
        relaunch(self, index)

    def node_dead(self, index: int) -> bool:
        """Whether Ray reports the node of server `index` dead (blocking: one question to Ray's node table)."""
        return bool(self.on_lost_nodes([index]))

    def replaceable(self, index: int) -> bool:
        """Whether server `index` can move to a new engine host (hosts placed by Ray and a factory for more)."""
        return self.host_factory is not None and hasattr(self.procs[index], "host_answers")

    # ---- elastic changes (elastic.py) --------------------------------------------------------------------------------
    async def add(self, count: int = 1) -> list[int]:
        """Start `count` more servers; each joins once it holds the current weights and version (`elastic.join`)."""
        if self._growing_lock is None:
            self._growing_lock = asyncio.Lock()
        async with self._growing_lock:
            return await join(self, count)

    async def remove(self, index: int, drained: Any = None) -> None:
        """Take server `index` out of the pool; its requests move to the others (`elastic.leave`)."""
        await leave(self, index, drained)
