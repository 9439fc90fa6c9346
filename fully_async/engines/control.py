"""The control plane: one control call (pause, resume, reload, set version, reset prefix cache, rpc) fanned out to the
servers of a pool at once, each within a deadline.

`ControlPlane.deadline_s` (engine.control_timeout_s) is the one deadline of a pool-wide call: a server that has not
answered by then fails the call (EngineError naming it and its log). A pool-wide call goes on without a server that
died under it: the pool marks it down and hands it to its `on_dead` (the client restarts it, and it gets the current
weights and version before it serves again); a live server that failed still fails the call.

The shapes of the calls come from the engine kind (base.py `EngineKind.*_call`); the servers, their states and the
membership lock from the pool (pool.py). engine=sim delivers the same calls in process (sim.py `SimControl`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp

from fully_async.engines.auth import auth_headers
from fully_async.engines.errors import EngineError
from fully_async.engines.slots import SlotState
from fully_async.engines.types import HttpCall, PauseMode

logger = logging.getLogger(__name__)


class ControlPlane:
    """Control calls on the serving servers of `pool` (an `EngineServers`), each within `deadline_s`."""

    def __init__(self, pool: Any, deadline_s: float) -> None:
        self.pool = pool
        self.deadline_s = deadline_s

    # ---- pool-wide operations ----------------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        """abort: in-flight requests return their tokens so far (the client continues them after resume);
        keep: they freeze and finish after resume."""
        self.pool.state.set_paused(True)
        await self.call_all("pause", self.pool.pause_call(mode))

    async def resume(self) -> None:
        await self.call_all("resume", self.pool.resume_call())
        self.pool.state.set_paused(False)

    async def set_version(self, version: int) -> None:
        """Label every serving server's next tokens with `version`. The caller holds the pool's membership lock."""
        await self.call_all("set version", self.pool.set_version_call(version))
        self.pool.state.version = version

    async def reset_prefix_cache(self) -> None:
        await self.call_all("reset prefix cache", self.pool.reset_prefix_cache_call())

    async def is_paused(self, url: str) -> bool:
        call, read = self.pool.is_paused_call()
        (body,) = await self.call_all("is paused", call, [url])
        return bool(read(body))

    async def rpc(self, url: str, method: str, spec: str, timeout_s: float) -> list[Any]:
        """`method(spec)` on every worker of the server at `url`, within `timeout_s`; the workers' answers."""
        (body,) = await self.call_all(method, self.pool.rpc_call(method, spec), [url], timeout_s=timeout_s)
        return (body or {}).get("results", body)

    async def reload(self, weights_dir: Path, node_dirs: dict[str, Path], procs: list[Any], nodes: list[Any]) -> None:
        """Reload the servers `procs` (in the pool or about to join it), each on its node in `nodes` from that node's
        copy in `node_dirs` when it has one, else from `weights_dir`: one call per directory, all at once."""
        by_dir: dict[Path, list[str]] = {}
        for proc, node in zip(procs, nodes):
            by_dir.setdefault(node_dirs.get(node, weights_dir), []).append(proc.url)
        results = await asyncio.gather(
            *(self.call_all("reload weights", self.pool.reload_weights_call(d), urls) for d, urls in by_dir.items()),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise EngineError("; ".join(str(e) for e in errors))

    # ---- weight syncs ------------------------------------------------------------------------------------------------
    async def load_weights(
        self, weights_dir: str | Path, version: int, node_dirs: dict[str, str] | None = None
    ) -> None:
        """`EngineServers.load_weights`: every serving server reloads (stale ones included, so they serve again), the
        prefix caches are reset and the version set, all under the pool's membership lock."""
        pool = self.pool
        weights_dir = Path(weights_dir).resolve()
        routed = {node: Path(d) for node, d in (node_dirs or {}).items()}
        async with pool.membership:
            await self._reload_serving(weights_dir, routed)
            pool.weights_dir, pool.node_dirs = weights_dir, routed
            rejoin = bool(pool.slots.count(SlotState.STALE))
            pool.slots.sync_reached()  # every server in the pool, stale ones included, holds this version now
            try:
                # KV blocks cached under the old weights must not serve continued prompts.
                await self.reset_prefix_cache()
            except EngineError as e:  # with pause(keep) frozen requests hold blocks; the cache then drains alone
                logger.warning("prefix cache not reset after a weight reload: %s", e)
            await self.set_version(version)
            if rejoin:
                await pool.sync_router_async()

    async def weights_received(self, version: int, epoch: int) -> None:
        """`EngineServers.weights_received`: the version without a reload; stale servers serve again only when the
        weight group that reached every server was formed at the pool's current epoch."""
        pool = self.pool
        pool.weights_dir = None  # the latest weights are in no directory: a restart must wait for the next sync
        try:
            await self.reset_prefix_cache()
        except EngineError as e:
            logger.warning("prefix cache not reset after a weight sync: %s", e)
        async with pool.membership:
            await self.set_version(version)
        if epoch == pool.epoch and pool.slots.count(SlotState.STALE):
            pool.slots.sync_reached()
            await pool.sync_router_async()

    async def _reload_serving(self, weights_dir: Path, node_dirs: dict[str, Path]) -> None:
        """`reload_indices` on every serving server; one that died meanwhile is dropped as `call_all` drops it."""
        pool = self.pool
        try:
            await self.reload_indices(weights_dir, node_dirs, pool.serving)
        except EngineError:
            dead = [i for i in pool.serving if not await asyncio.to_thread(pool.is_alive, i)]
            if not dead:
                raise
            for i in dead:
                logger.warning("reload weights: engine server %s is gone; the pool goes on without it", pool.address(i))
                pool.server_died(i)
            await pool.sync_router_async()
            await self.reload_indices(weights_dir, node_dirs, pool.serving)

    async def reload_indices(self, weights_dir: Path, node_dirs: dict[str, Path], indices: list[int]) -> None:
        """Reload the pool's servers `indices`, each from its node's copy in `node_dirs` when it has one, else
        `weights_dir`."""
        nodes = [self.pool.node_of(i)["node_id"] if node_dirs else None for i in indices]
        await self.reload(weights_dir, node_dirs, [self.pool.procs[i] for i in indices], nodes)

    # ---- the fan-out -------------------------------------------------------------------------------------------------
    async def call_all(
        self, what: str, call: HttpCall, urls: list[str] | None = None, timeout_s: float | None = None
    ) -> list[Any]:
        """Run `call` on every server in `urls` at once (None: every serving server of the pool, and then servers that
        died under it are dropped), each within `timeout_s` (default `deadline_s`); EngineError naming each failed
        server (and its log) otherwise. The answers, in the order of `urls` (None for a dropped server)."""
        pool = self.pool
        tolerate = urls is None
        urls = [pool.address(i) for i in pool.serving] if urls is None else urls
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.deadline_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session:
            results = await asyncio.gather(*(self.call_one(session, url, call) for url in urls), return_exceptions=True)
        if tolerate:
            results = await self._drop_dead(what, urls, results)
        failed = [f"{url}: {r} (log: {pool.log_for(url)})" for url, r in zip(urls, results) if isinstance(r, Exception)]
        if failed:
            raise EngineError(
                f"{pool.kind} {what} failed on {len(failed)} of {len(urls)} servers: " + "; ".join(failed)
            )
        return results

    async def _drop_dead(self, what: str, urls: list[str], results: list[Any]) -> list[Any]:
        """Each failed server whose process (or engine host, or node) is gone is marked down and handed to the pool's
        `on_dead`; its failure is dropped. A live server that failed keeps its failure."""
        pool = self.pool
        index = {pool.address(i): i for i in pool.live}
        out = list(results)
        for k, (url, r) in enumerate(zip(urls, results)):
            if not isinstance(r, Exception) or url not in index:
                continue
            if await asyncio.to_thread(pool.is_alive, index[url]):
                continue
            logger.warning("%s: engine server %s is gone (%s); the pool goes on without it", what, url, r)
            pool.server_died(index[url])
            out[k] = None
        if any(r is None and isinstance(x, Exception) for r, x in zip(out, results)):
            await pool.sync_router_async()
        return out

    @staticmethod
    async def call_one(session: aiohttp.ClientSession, url: str, call: HttpCall) -> Any:
        """`call` on the server at `url`: its JSON answer (or text); EngineError on an HTTP error, no answer in time,
        a broken connection, or an answer the call's `check` refuses."""
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
