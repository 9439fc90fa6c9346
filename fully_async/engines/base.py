"""The engine boundary: what the rollout path needs from a pool of inference servers, whatever their kind.

An `EngineServers` owns N server processes (or attaches to servers started elsewhere) and drives all of them at once
through the control plane: pause, resume, reload weights, set the weight version, reset the prefix cache. An adapter
(vLLM here, SGLang later) supplies only what differs between engine kinds: the command line and environment, the
endpoints, and the shape of a token-level generate request and its response. `EngineClient` (client.py) is generic.

Version bookkeeping: `state.version` is the number of completed weight syncs whose weights the servers hold; the
control plane sets it (and tells the servers, which label the tokens they produce with it where the engine supports
that). `state` also carries the pause flag and the event an aborted request waits on before it continues.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp

from fully_async.config import EngineConfig
from fully_async.engines.errors import EngineError
from fully_async.engines.process import ServerProcess

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "keep"]


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request; the same values must be used by the trainer for its log-probs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_rollout(cls, rollout: Any, **overrides: Any) -> Sampling:
        """From a RolloutConfig (temperature, top_p, top_k)."""
        values = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)
        return cls(**{**values, **overrides})


@dataclass
class GenerationResult:
    """One finished sample. token_ids, logprobs and versions have equal length (at most the requested budget); each
    is a list, or the engine's numpy array when the sample came from one segment whose tokens were all kept."""

    token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each chosen token under the distribution it was sampled from."""
    versions: list[int]
    """Weight version that produced each token."""
    finish_reason: str
    """'stop' (an end token or stop id, included in token_ids) or 'length' (budget spent)."""
    start_version: int = 0
    """Weight version when the request was first sent."""
    num_aborts: int = 0
    """Times a pause aborted the request and it was continued from its tokens so far."""
    num_retries: int = 0
    """Times the request was re-sent after a server failure."""
    servers: list[str] = field(default_factory=list)
    """URL of the server of each segment, in order."""


@dataclass
class Segment:
    """What one HTTP generate call returned (parsed by the adapter). The three sequences are lists, or numpy arrays
    (int32 ids and versions, float32 log-probs) from an engine that has them without parsing (engine=sim); the
    client passes a sample's only segment through as it is, so an array is never converted element by element."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int | None] | None = None
    """Per-token versions reported by the engine, None where it reported none (the client then uses its own)."""


@dataclass(frozen=True)
class HttpCall:
    """One control-plane HTTP call, built by the adapter and run by the generic machinery on every server."""

    method: str
    path: str
    params: dict[str, str] | None = None
    json: Any = None
    check: Any = None
    """Optional callable(response_json) -> error string or None, for endpoints that report failure in a 200."""


class EngineState:
    """Version and pause state shared by the control plane and the clients in this process."""

    def __init__(self) -> None:
        self.version = 0
        self.paused = False
        self._resumed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def resumed(self) -> asyncio.Event:
        """Set while not paused. Re-created per event loop: an asyncio.Event is bound to the loop that first waits on
        it, and lifecycle code (or a test) may drive this state from a different loop later."""
        loop = asyncio.get_running_loop()
        if self._resumed is None or self._loop is not loop:
            self._resumed, self._loop = asyncio.Event(), loop
            if not self.paused:
                self._resumed.set()
        return self._resumed

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if paused:
            self.resumed.clear()
        else:
            self.resumed.set()


class EngineServers(abc.ABC):
    """A pool of engine servers of one kind: lifecycle (start, stop, restart one) and the control plane for all."""

    kind: str = "?"
    in_process = False
    """True for emulated engines that answer generate requests through `send_direct` instead of HTTP."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_path: str | Path,
        run_dir: str | Path,
        addresses: list[str] | None = None,
        hosts: list[Any] | None = None,
        device: str | None = None,
        weight_receiver: bool = False,
    ):
        """addresses: attach to servers already running there (nothing is launched, restart is impossible);
        hosts: one `EngineHost` actor per server (engines/host.py), placed by the job: each server runs on its
        host's node; neither: the servers are child processes of this one. device: 'cuda' or 'cpu' (the job's
        fully_async.host.device; None = this machine's). weight_receiver: start the servers with the collective
        transport's receiver (async_training.weight_transport=collective)."""
        from fully_async.host import device as run_device

        self.cfg = cfg
        self.model_path = Path(model_path)
        self.run_dir = Path(run_dir)
        self.device = device or run_device("auto")
        self.state = EngineState()
        self.weights_dir: Path | None = None
        """Directory of the weights loaded last; a restarted server reloads it (or its node's copy, below)."""
        self.node_dirs: dict[str, Path] = {}
        """Ray node id -> that node's copy of `weights_dir`, for servers on nodes that cannot read it (disk
        transport, fully_async/weights/disk.py)."""
        self.weight_receiver = weight_receiver
        self.epoch = 0
        """Bumped whenever a server is restarted: a weight group formed at an older epoch must be re-formed."""
        self.stale: set[int] = set()
        """Servers restarted on weights older than the current version (the collective transport's weights exist
        nowhere on disk): kept out of rotation by the client until the next sync sends them the current version."""
        self.hosts = hosts
        self.host_factory: Any = None
        """Makes engine hosts for servers added or replaced while the run goes on (`create(index)`, `release(host)`);
        set by the rollouter when the job placed the servers through Ray."""
        self.retired: set[int] = set()
        """Indices of servers removed from the pool; slots are never reused, so indices stay stable."""
        self.down: set[int] = set()
        """Servers whose process died (shared with the client, which skips them until they are back)."""
        self.on_dead: Any = None
        """Called with the index of a server a control call found dead (the client schedules its restart)."""
        self._membership: asyncio.Lock | None = None
        self._growing_lock: asyncio.Lock | None = None
        self.pool_events: list[tuple[str, int, str, str | None]] = []
        """(event, index, url, new url) for joins, leaves and replacements, in order (the rollouter's metrics)."""
        self.router: Any = None
        """A router process in front of the servers (engine.router; `make_router`), started and stopped with the pool:
        generation goes through it, control calls still go to each server. Its worker list follows the pool."""
        if addresses is not None:
            self.procs = [ServerProcess.external(url) for url in addresses]
        else:
            count = len(hosts) if hosts is not None else cfg.num_servers
            self.procs = [self._new_process(i) for i in range(count)]

    # ---- adapter hooks -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def command(self, index: int, port: int, host: str | None = None) -> list[str]:
        """Command line of server `index` listening on `host` (None: the local bind address) and `port`."""

    @abc.abstractmethod
    def environment(self, index: int) -> dict[str, str]:
        """Environment variables added for server `index`."""

    health_path = "/health"

    @abc.abstractmethod
    def generate_request(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> tuple[str, dict]:
        """(path, JSON body) of a token-level generate call returning log-probs of the chosen tokens."""

    @abc.abstractmethod
    def parse_generate(self, body: Any) -> Segment:
        """Parse a generate response; raise ValueError when it is malformed."""

    async def send_direct(self, idx: int, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> Segment:
        """Generate on server `idx` without HTTP (only where `in_process`)."""
        raise NotImplementedError(f"{self.kind} servers are reached over HTTP")

    @abc.abstractmethod
    def pause_call(self, mode: PauseMode) -> HttpCall: ...

    @abc.abstractmethod
    def resume_call(self) -> HttpCall: ...

    @abc.abstractmethod
    def is_paused_call(self) -> tuple[HttpCall, Any]:
        """The call and a function(response_json) -> bool."""

    @abc.abstractmethod
    def reload_weights_call(self, weights_dir: Path) -> HttpCall: ...

    @abc.abstractmethod
    def set_version_call(self, version: int) -> HttpCall: ...

    @abc.abstractmethod
    def reset_prefix_cache_call(self) -> HttpCall: ...

    def make_router(self) -> Any:
        """The router this pool puts in front of its servers (engine.router), or None: the client balances itself."""
        return None

    def rpc_call(self, method: str, spec: str) -> HttpCall:
        """A call of `method(spec=<JSON string>)` on every worker of a server (the weight receiver's methods)."""
        raise NotImplementedError(f"{self.kind} servers have no weight receiver")

    @property
    def workers_per_server(self) -> int:
        """Worker processes per server (tensor-parallel ranks; one on CPU)."""
        return self.cfg.tensor_parallel_size if self.device == "cuda" else 1

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    @property
    def local_bind(self) -> str:
        """Bind address of servers started as children of this process ("auto" = loopback)."""
        return "127.0.0.1" if self.cfg.host == "auto" else self.cfg.host

    @property
    def membership(self) -> asyncio.Lock:
        """Held while the pool's members or their weights change (a sync's reload and version, a join, a rejoin), so a
        server never joins with weights older than the version it is labelled with."""
        if self._membership is None:
            self._membership = asyncio.Lock()
        return self._membership

    @property
    def _growing(self) -> asyncio.Lock:
        if self._growing_lock is None:
            self._growing_lock = asyncio.Lock()
        return self._growing_lock

    def _new_process(self, index: int, port: int | None = None, host: Any = None) -> ServerProcess:
        name, log_path = f"{self.kind}-{index}", self.run_dir / "engines" / f"{self.kind}-{index}.log"
        if host is None and self.hosts is not None and index < len(self.hosts):
            host = self.hosts[index]
        if host is not None:
            from fully_async.engines.host import RemoteServer

            return RemoteServer(
                name, host, lambda port, bind: self.command(index, port, bind),
                self.environment(index), log_path, self.health_path,
            )  # fmt: skip
        return ServerProcess(
            name=name,
            command=lambda port: self.command(index, port, self.local_bind),
            env=self.environment(index),
            log_path=log_path,
            host=self.local_bind,
            health_path=self.health_path,
            port=port,
        )

    def log_tail(self, index: int, lines: int = 40) -> str:
        """The last lines of server `index`'s log, read on its node."""
        return self.procs[index].tail(lines)

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

    def routed_urls(self) -> list[str]:
        """The servers a router may send requests to: in the pool, not down, not stale (old weights)."""
        return [self.procs[i].url for i in self.serving if i not in self.stale]

    def sync_router(self) -> None:
        """Make the router's worker list follow the pool (no-op without a router). Blocking: call it in a thread."""
        if self.router is not None:
            self.router.sync(self.routed_urls(), self.cfg.control_timeout_s)

    async def _sync_router(self) -> None:
        """`sync_router` from the event loop; a failure is logged (the router's own health checks still skip a dead
        server, and the next membership change syncs again)."""
        if self.router is None:
            return
        try:
            await asyncio.to_thread(self.sync_router)
        except EngineError as e:
            logger.warning("router worker list not updated: %s", e)

    def restart_router(self) -> None:
        """Start a router that died again, over the servers that may serve now (a new port). Blocking."""
        if self.router is not None and not self.router.is_alive():
            logger.error("the engine router died (log %s); restarting it", self.router.proc.log_path)
            self.router.restart(self.routed_urls(), self.cfg.startup_timeout_s)

    def start(self) -> None:
        """Launch every server and block until all are healthy (EngineError with the log tail otherwise)."""
        try:
            for p in self.procs:
                p.launch()
            for p in self.procs:
                p.wait_healthy(self.cfg.startup_timeout_s)
            self._run_sync(self._after_start(range(len(self.procs))))
            self.router = self.make_router()
            if self.router is not None:
                self.router.start(self.routed_urls(), self.cfg.startup_timeout_s)
        except BaseException:
            self.stop()  # a half-started pool would hold memory and cores until interpreter exit
            raise

    def stop(self) -> None:
        """Stop every launched server (and its children) and free the hosts made for added or replaced ones; safe to
        call twice."""
        if self.router is not None:
            self.router.stop()  # first: no request should reach a server that is going away
        for p in self.procs:
            p.stop()
        if self.host_factory is not None:
            self.host_factory.close()

    def is_alive(self, index: int) -> bool:
        return self.procs[index].is_alive()

    def log_path(self, index: int) -> Path | None:
        return self.procs[index].log_path

    def restart(self, index: int) -> None:
        """Restart server `index` with the latest weights and version (replaced on another node when its engine host
        is gone; see `relaunch`). Blocks until healthy."""
        self.relaunch(index)
        self._run_sync(self._after_start([index]))
        self.down.discard(index)
        self.sync_router()

    async def restart_async(self, index: int) -> None:
        """`restart` from the event loop that runs the control plane: the launch in a thread, the weights and version
        under `membership`, so a sync's reload and version never interleave with it."""
        await asyncio.to_thread(self.relaunch, index)
        async with self.membership:
            await self._after_start([index])
        self.down.discard(index)
        await self._sync_router()  # back (or replaced at a new address): the router sends to it again

    def relaunch(self, index: int) -> None:
        """Start server `index` again and wait until healthy (weights not loaded yet). A server whose engine host is
        gone (its node lost) gets a new host from `host_factory`, on whatever node has room: a new address."""
        proc = self.procs[index]
        self.epoch += 1  # its workers are new processes: any weight group it was in is gone
        if self.weights_dir is None and self.state.version > 0:
            self.stale.add(index)  # it comes back on its start-up weights; the next sync brings it up to date
        if self.replaceable(index) and not proc.host_alive():
            self._replace(index)
            return
        proc.stop()
        proc.launch()
        proc.wait_healthy(self.cfg.startup_timeout_s)

    def replaceable(self, index: int) -> bool:
        """Whether server `index` can move to a new engine host (hosts placed by Ray and a factory for more)."""
        return self.host_factory is not None and hasattr(self.procs[index], "host_alive")

    def _replace(self, index: int) -> None:
        old = self.procs[index]
        host = self.host_factory.create(index)
        proc = self._new_process(index, host=host)
        try:
            proc.launch()
            proc.wait_healthy(self.cfg.startup_timeout_s)
        except BaseException:
            proc.stop()
            self.host_factory.release(host)
            raise
        self.host_factory.release(old.host)
        self.procs[index] = proc
        self.pool_events.append(("replace", index, old.url, proc.url))
        logger.warning("engine server %s (host lost) replaced by %s", old.url, proc.url)

    # ---- elastic pool ------------------------------------------------------------------------------------------------
    @property
    def live(self) -> list[int]:
        """Indices of the servers in the pool (not removed)."""
        return [i for i in range(len(self.procs)) if i not in self.retired]

    @property
    def serving(self) -> list[int]:
        """Servers in the pool and not down (dead, being restarted or replaced): pool-wide control calls go to these;
        one that comes back gets the current weights and version before it serves (`_after_start`)."""
        return [i for i in range(len(self.procs)) if i not in self.retired and i not in self.down]

    async def add(self, count: int = 1) -> list[int]:
        """Start `count` more servers at once (each on a new engine host from `host_factory` when the job placed the
        servers through Ray, else as child processes), load the current weights and version into them, and only then
        append them to the pool (the client picks them up from there): their first tokens carry the current version.
        Returns their indices. Servers that fail to start are stopped and their hosts freed; EngineError names them
        after the others joined."""
        async with self._growing:
            base = len(self.procs)
            if self.hosts is not None and self.host_factory is None:
                raise EngineError("this engine pool cannot grow: its servers were placed without a host factory")

            async def start_one(index: int) -> ServerProcess:
                host = None
                if self.hosts is not None:
                    host = await asyncio.to_thread(self.host_factory.create, index)
                proc = self._new_process(index, host=host)
                try:
                    await asyncio.to_thread(proc.launch)
                    await asyncio.to_thread(proc.wait_healthy, self.cfg.startup_timeout_s)
                except BaseException:
                    await asyncio.to_thread(proc.stop)
                    if host is not None:
                        self.host_factory.release(host)
                        self.host_factory.release_slot(index)
                    raise
                return proc

            results = await asyncio.gather(*(start_one(base + k) for k in range(count)), return_exceptions=True)
            started = [r for r in results if not isinstance(r, BaseException)]
            joined: list[int] = []
            async with self.membership:
                urls = [p.url for p in started]
                if urls:
                    if self.weights_dir is not None:
                        nodes = [_node_of(p)["node_id"] if self.node_dirs else None for p in started]
                        await self._reload_procs(self.weights_dir, self.node_dirs, started, nodes)
                    await self._call_all("set version", self.set_version_call(self.state.version), urls)
                    if self.state.paused:  # joined during a sync: paused like the others until its resume
                        await self._call_all("pause", self.pause_call("abort"), urls)
                for proc in started:
                    joined.append(len(self.procs))
                    self.procs.append(proc)
                    self.pool_events.append(("join", joined[-1], proc.url, None))
                    if self.weights_dir is None and self.state.version > 0:
                        # The current weights are in no directory (collective transport): it serves from the next
                        # sync on, which re-forms the weight group with it (the epoch says the members changed).
                        self.stale.add(joined[-1])
                if started:
                    self.epoch += 1
            await self._sync_router()
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise EngineError(
                    f"{len(failed)} of {count} new {self.kind} servers did not start ({len(joined)} joined): "
                    + "; ".join(f"{type(e).__name__}: {e}" for e in failed)
                )
            return joined

    async def remove(self, index: int, drained: Any = None) -> None:
        """Take server `index` out of the pool: the caller has stopped sending to it; abort what it still runs (the
        client continues those requests elsewhere), wait for `drained()` (an awaitable factory: the client's
        requests on it are done), stop it and free its host."""
        url = self.procs[index].url
        async with self.membership:
            self.retired.add(index)
            self.stale.discard(index)
            self.epoch += 1  # a weight group that spans it must be re-formed without it
        await self._sync_router()  # before the abort: the router must not send the continuations back to it
        try:
            await self._call_all("pause", self.pause_call("abort"), [url])
        except EngineError as e:  # a dead server has nothing to abort
            logger.warning("aborting the requests of %s on removal: %s", url, e)
        if drained is not None:
            await drained()
        proc = self.procs[index]
        await asyncio.to_thread(proc.stop)
        if self.host_factory is not None and getattr(proc, "host", None) is not None:
            self.host_factory.release(proc.host)
        self.pool_events.append(("leave", index, url, None))

    async def _after_start(self, indices) -> None:
        urls = [self.procs[i].url for i in indices]
        if self.weights_dir is not None:
            try:
                await self._reload(self.weights_dir, self.node_dirs, list(indices))
            except EngineError as e:
                # Multi-node disk weights: a server replaced onto a node that has no copy yet cannot read the
                # trainer's directory. It waits out of rotation (stale) for the next sync, which copies to its node.
                uncopied = [i for i in indices if self.node_dirs and self.node_of(i)["node_id"] not in self.node_dirs]
                if not uncopied:
                    raise
                logger.warning("servers %s have no copy of the weights on their node yet (%s); they serve from the "
                               "next sync on", [self.procs[i].url for i in uncopied], e)  # fmt: skip
                self.stale.update(uncopied)
                self.epoch += 1
        await self._call_all("set version", self.set_version_call(self.state.version), urls)
        if self.state.paused:  # back during a sync: paused like the others until its resume
            await self._call_all("pause", self.pause_call("abort"), urls)

    def node_of(self, index: int) -> dict[str, Any]:
        """{"node_id", "node_ip", "host"} of server `index`: its engine host's node and handle; for a server that
        is a child of this process (or attached by address), node_id is None: this process's node."""
        return _node_of(self.procs[index])

    async def _reload_serving(self, weights_dir: Path, node_dirs: dict[str, Path]) -> None:
        """`_reload` on every serving server; one that died meanwhile is dropped as `_call_all` drops it."""
        try:
            await self._reload(weights_dir, node_dirs, self.serving)
        except EngineError:
            dead = [i for i in self.serving if not await asyncio.to_thread(self.is_alive, i)]
            if not dead:
                raise
            for i in dead:
                logger.warning("reload weights: engine server %s is gone; the pool goes on without it", self.address(i))
                self.down.add(i)
                if self.on_dead is not None:
                    self.on_dead(i)
            await self._sync_router()
            await self._reload(weights_dir, node_dirs, self.serving)

    async def _reload(self, weights_dir: Path, node_dirs: dict[str, Path], indices: list[int]) -> None:
        """Reload servers `indices`, each from its node's copy in `node_dirs` when it has one, else `weights_dir`."""
        nodes = [self.node_of(i)["node_id"] if node_dirs else None for i in indices]
        await self._reload_procs(weights_dir, node_dirs, [self.procs[i] for i in indices], nodes)

    async def _reload_procs(
        self, weights_dir: Path, node_dirs: dict[str, Path], procs: list[Any], nodes: list[str | None]
    ) -> None:
        """`_reload` for server processes (not yet in the pool, for a join) on the given nodes."""
        by_dir: dict[Path, list[str]] = {}
        for proc, node in zip(procs, nodes):
            by_dir.setdefault(node_dirs.get(node, weights_dir), []).append(proc.url)
        results = await asyncio.gather(
            *(self._call_all("reload weights", self.reload_weights_call(d), urls) for d, urls in by_dir.items()),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise EngineError("; ".join(str(e) for e in errors))

    @staticmethod
    def _run_sync(coro) -> None:
        """Run a control coroutine to completion from synchronous lifecycle code. A private thread gives it its own
        event loop, so this works whether or not the caller's thread already runs one."""
        errors: list[BaseException] = []

        def target() -> None:
            try:
                asyncio.run(coro)
            except BaseException as e:  # re-raised in the caller's thread below
                errors.append(e)

        thread = threading.Thread(target=target, name="engine-control")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    # ---- control plane ---------------------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        """abort: in-flight requests return their tokens so far (the client continues them after resume);
        keep: they freeze and finish after resume."""
        self.state.set_paused(True)
        await self._call_all("pause", self.pause_call(mode))

    async def resume(self) -> None:
        await self._call_all("resume", self.resume_call())
        self.state.set_paused(False)

    async def load_weights(
        self, weights_dir: str | Path, version: int, node_dirs: dict[str, str] | None = None
    ) -> None:
        """Reload weights from a directory of safetensors (checkpoint names) on every server, then set the version.
        `node_dirs`: Ray node id -> a copy of that directory on that node, which the node's servers reload instead.
        Call between pause and resume."""
        weights_dir = Path(weights_dir).resolve()
        routed = {node: Path(d) for node, d in (node_dirs or {}).items()}
        async with self.membership:
            await self._reload_serving(weights_dir, routed)
            self.weights_dir, self.node_dirs = weights_dir, routed
            rejoin = bool(self.stale)
            self.stale.clear()  # every server in the pool, stale ones included, holds this version now
            try:
                # KV blocks cached under the old weights must not serve continued prompts.
                await self.reset_prefix_cache()
            except EngineError as e:  # with pause(keep) frozen requests hold blocks; the cache then drains alone
                logger.warning("prefix cache not reset after a weight reload: %s", e)
            await self._set_version(version)
            if rejoin:
                await self._sync_router()

    async def weights_received(self, version: int, epoch: int) -> None:
        """Every server received `version` through a weight group formed at `epoch` (collective transport): reset
        prefix caches and set the version, without a reload. Servers restarted since (a newer epoch) stay stale."""
        self.weights_dir = None  # the latest weights are in no directory: a restart must wait for the next sync
        try:
            await self.reset_prefix_cache()
        except EngineError as e:
            logger.warning("prefix cache not reset after a weight sync: %s", e)
        await self.set_version(version)
        if epoch == self.epoch and self.stale:
            self.stale.clear()
            await self._sync_router()

    def layout(self, down: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
        """For the collective transport: the pool's epoch and the servers a weight group spans now (all but
        `down`), each with its index, URL and worker count."""
        servers = [{"index": i, "url": p.url, "workers": self.workers_per_server}
                   for i, p in enumerate(self.procs) if i not in down and i not in self.retired]  # fmt: skip
        return {"epoch": self.epoch, "servers": servers}

    async def rpc(self, index: int, method: str, spec: str, timeout_s: float) -> list[Any]:
        """`method(spec)` on every worker of server `index`; the workers' answers."""
        url = self.procs[index].url
        (body,) = await self._call_all(method, self.rpc_call(method, spec), [url], timeout_s=timeout_s)
        return (body or {}).get("results", body)

    async def set_version(self, version: int) -> None:
        async with self.membership:
            await self._set_version(version)

    async def _set_version(self, version: int) -> None:
        await self._call_all("set version", self.set_version_call(version))
        self.state.version = version

    async def reset_prefix_cache(self) -> None:
        await self._call_all("reset prefix cache", self.reset_prefix_cache_call())

    async def is_paused(self, url: str) -> bool:
        call, read = self.is_paused_call()
        (body,) = await self._call_all("is paused", call, [url])
        return bool(read(body))

    async def _call_all(
        self, what: str, call: HttpCall, urls: list[str] | None = None, timeout_s: float | None = None
    ) -> list[Any]:
        """Run `call` on every server at once (each within `timeout_s`, default engine.control_timeout_s); EngineError
        naming each failed server (and its log) otherwise."""
        tolerate = urls is None
        urls = [self.procs[i].url for i in self.serving] if urls is None else urls
        from fully_async.engines.auth import auth_headers

        timeout = aiohttp.ClientTimeout(total=timeout_s or self.cfg.control_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session:
            results = await asyncio.gather(
                *(self._call_one(session, url, call) for url in urls), return_exceptions=True
            )
        if tolerate:
            results = await self._drop_dead(what, urls, results)
        failed = [f"{url}: {r} (log: {self.log_for(url)})" for url, r in zip(urls, results) if isinstance(r, Exception)]
        if failed:
            raise EngineError(
                f"{self.kind} {what} failed on {len(failed)} of {len(urls)} servers: " + "; ".join(failed)
            )
        return results

    async def _drop_dead(self, what: str, urls: list[str], results: list[Any]) -> list[Any]:
        """A pool-wide control call (a sync's pause, reload, version, resume) goes on without servers that died under
        it: each failed server whose process (or engine host, or node) is gone is marked down and handed to
        `on_dead` (the client restarts or replaces it, and it gets the current weights and version then); its
        failure is dropped. A live server that failed still fails the call."""
        index = {self.procs[i].url: i for i in self.live}
        out = list(results)
        for k, (url, r) in enumerate(zip(urls, results)):
            if not isinstance(r, Exception) or url not in index:
                continue
            i = index[url]
            if await asyncio.to_thread(self.is_alive, i):
                continue
            logger.warning("%s: engine server %s is gone (%s); the pool goes on without it", what, url, r)
            self.down.add(i)
            out[k] = None
            if self.on_dead is not None:
                self.on_dead(i)
        if self.router is not None and any(r is None and isinstance(x, Exception) for r, x in zip(out, results)):
            await self._sync_router()
        return out

    @staticmethod
    async def _call_one(session: aiohttp.ClientSession, url: str, call: HttpCall) -> Any:
        try:
            async with session.request(call.method, url + call.path, params=call.params, json=call.json) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise EngineError(f"HTTP {resp.status}: {text[:300]}")
        except asyncio.TimeoutError as e:
            raise EngineError(f"no answer to {call.method} {call.path} within the control timeout") from e
        except aiohttp.ClientError as e:
            raise EngineError(f"{call.method} {call.path}: {type(e).__name__}: {e}") from e
        try:
            body = json.loads(text) if text.strip() else None
        except ValueError:
            body = text  # a plain-text answer (SGLang's /flush_cache); `check` may read it
        if call.check is not None and (err := call.check(body)):
            raise EngineError(err)
        return body

    def log_for(self, url: str) -> str:
        if self.router is not None and url == self.router.url:
            return str(self.router.proc.log_path)
        for p in self.procs:
            if p.url == url:
                return str(p.log_path) if p.log_path else "external server, no log here"
        return "unknown server"


def _node_of(proc: Any) -> dict[str, Any]:
    if hasattr(proc, "node"):  # a RemoteServer: its engine host's node
        return {**proc.node, "host": proc.host}
    return {"node_id": None, "node_ip": None, "host": None}
