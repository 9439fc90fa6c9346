"""LoRA adapters served by an engine pool: which versioned adapters each server holds, which one new requests name,
and which ones requests still use (the adapter sync, fully_async/weights/lora.py, drives it). The pool holds them in
what its servers must load before they serve (`EngineServers.weights.adapters`, served.py).

Version N > 0 of the policy is the adapter `policy-vN`, loaded beside the base model in every server; version 0 is
the base model itself (LoRA's B starts at zero, so base == adapter v0) and names no adapter. A sync loads the new
name into every serving server (`load`), then makes it the one new requests name (`activate`: the pool's version moves
only then), then unloads old names (`unload`). Loading a name does not disturb requests on another, so an adapter
sync does not pause the engines: a request in flight finishes on the adapter it named, and its tokens carry that
adapter's version (the client labels them; the servers' /update_weight_version spans would label them with the newest).

The unload rule: the newest `keep` names (async_training.max_staleness + 2: the versions a request inside the
staleness bound can still name, and the one being activated) stay; an older one goes only once no request names it
(`in_use`, counted by the client per request in flight, a request frozen by a pause included). A server that
(re)starts or joins loads the current adapter (and any loaded but not yet activated) before it serves
(`bring_current`).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fully_async.aio import NamedLock
from fully_async.engines.base import EngineKind
from fully_async.engines.errors import EngineError
from fully_async.engines.types import EngineState
from fully_async.weights.lora import LoraServing, adapter_name

if TYPE_CHECKING:
    from fully_async.engines.control import ControlPlane

logger = logging.getLogger(__name__)


@runtime_checkable
class AdaptedPool(Protocol):
    """What the adapter state reads of its pool (pool.py `EngineServers`): the serving servers, their nodes, the
    control plane that reaches them and the membership lock a sync's version holds."""

    kind: EngineKind
    state: EngineState
    control: ControlPlane

    @property
    def membership(self) -> NamedLock: ...
    @property
    def serving(self) -> list[int]: ...
    def address(self, index: int) -> str: ...
    def node_of(self, index: int) -> dict[str, Any]: ...


class Adapters:
    """The adapter state of one pool (see the module docstring). Its methods run on the pool's event loop."""

    def __init__(self, pool: AdaptedPool, serving: LoraServing) -> None:
        self.pool = pool
        self.serving = serving
        self.current: str | None = None
        """The name new requests use (None: the base model)."""
        self.loaded: dict[str, tuple[Path, dict[str, Path]]] = {}
        """Names loaded pool-wide, oldest first -> (their directory, {Ray node id: that node's copy})."""
        self.held: dict[str, set[str]] = {}
        """Server URL -> the names loaded there (unload calls only these; a restarted server holds fewer)."""
        self.in_use: Counter[str] = Counter()
        """Name -> requests in flight that name it (the client's `acquire` / `release`)."""

    # ---- the client's side ---------------------------------------------------------------------------------------
    def acquire(self, version: int) -> str | None:
        """The adapter a request sent now under `version` names, counted as in use until `release`."""
        name = adapter_name(version)
        if name is not None:
            self.in_use[name] += 1
        return name

    def release(self, name: str | None) -> None:
        if name is not None:
            self.in_use[name] -= 1
            if self.in_use[name] <= 0:
                del self.in_use[name]

    # ---- a sync ------------------------------------------------------------------------------------------------------
    async def load(self, name: str, path: str | Path, node_dirs: dict[str, str | None] | None = None) -> None:
        """Load adapter `name` from `path` (servers on a node in `node_dirs`: that node's copy) into every serving
        server at once (a slow call, engine.control_timeout_s with the liveness probe; a server that stops answering
        is set aside, one whose node got no copy too). Any other failure fails the call naming the server."""
        pool = self.pool
        control = pool.control
        async with pool.membership:
            routed = await control.route_copies("load adapter", node_dirs)
            indices = pool.serving
            calls = [(pool.address(i), self._load_call(name, Path(path), routed, pool.node_of(i)["node_id"]))
                     for i in indices]  # fmt: skip
            results = await control.fan_out(f"load adapter {name}", calls, control.timeout_s, slow=True,
                                            pool_wide=True)  # fmt: skip
            for (url, _), result in zip(calls, results):
                if result is not None:
                    self.held.setdefault(url, set()).add(name)
            self.loaded.pop(name, None)
            self.loaded[name] = (Path(path), routed)

    def _load_call(self, name: str, path: Path, routed: dict[str, Path], node: str | None):
        return self.pool.kind.load_adapter_call(name, routed.get(node, path) if node is not None else path)

    async def activate(self, name: str, version: int) -> None:
        """New requests name `name`, labelled `version`, from now on (every serving server holds it: `load`)."""
        if name not in self.loaded:
            raise EngineError(f"adapter {name!r} cannot be activated: it was not loaded")
        async with self.pool.membership:
            self.current = name
            self.pool.state.version = version

    async def unload(self) -> dict[str, list[str]]:
        """Unload the names older than the newest `max_loras` that no request uses, from every server holding them
        (pool-wide, within engine.control_deadline_s). Returns {"unloaded": names, "loaded": the names left, oldest
        first}; a name kept because a request still names it is logged."""
        keep = set(list(self.loaded)[-self.serving.max_loras :]) | {self.current}
        old = [n for n in self.loaded if n not in keep]
        busy = [n for n in old if self.in_use.get(n)]
        if busy:
            logger.info("adapters %s stay loaded: %s request(s) still name them", busy, [self.in_use[n] for n in busy])
        gone = [n for n in old if not self.in_use.get(n)]
        if gone:
            pool = self.pool
            calls = [(url, pool.kind.unload_adapter_call(n)) for url, names in self.held.items() for n in gone
                     if n in names and url in {pool.address(i) for i in pool.serving}]  # fmt: skip
            await pool.control.fan_out("unload adapters", calls, pool.control.deadline_s, pool_wide=True)
            for name in gone:
                del self.loaded[name]
                for names in self.held.values():
                    names.discard(name)
        return {"unloaded": gone, "loaded": list(self.loaded)}

    async def resume(self, path: str | Path, version: int, node_dirs: dict[str, str | None] | None = None) -> None:
        """A resumed run's first weights: the adapter of `version` in `path` loaded and activated (version 0: the
        base model, nothing to load)."""
        name = adapter_name(version)
        if name is not None:
            await self.load(name, path, node_dirs)
            await self.activate(name, version)
        else:
            self.pool.state.version = 0

    # ---- servers that (re)start or join ------------------------------------------------------------------------------
    async def bring_current(self, procs: list[Any]) -> None:
        """Servers `procs` (processes healthy again, or joining), without adapters: load the current one and any
        loaded after it (a sync between its load and its activation), each from the server's node's copy when it
        has one. The caller holds the pool's membership lock."""
        from fully_async.engines.process import node_of

        names = list(self.loaded)
        if self.current in names:
            names = names[names.index(self.current) :]
        for proc in procs:
            self.held[proc.url] = set()
        for name in names:
            path, routed = self.loaded[name]
            calls = [(p.url, self._load_call(name, path, routed, node_of(p)["node_id"] if routed else None))
                     for p in procs]  # fmt: skip
            await self.pool.control.fan_out(f"load adapter {name}", calls, self.pool.control.timeout_s, slow=True)
            for proc in procs:
                self.held[proc.url].add(name)

    def state(self) -> dict[str, Any]:
        """For stats and tests: the current name, the loaded names (oldest first) and the requests per name."""
        return {"current": self.current, "loaded": list(self.loaded), "in_use": dict(self.in_use)}
