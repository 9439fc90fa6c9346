"""The control plane: one control call (pause, resume, reload, set version, reset prefix cache, rpc) fanned out to the
servers of a pool at once, each within a bound, and what happens to a server that does not answer.

Two bounds (docs/engines.md, "A hung server"):
- `deadline_s` (engine.control_deadline_s, seconds): a pool-wide call (pause, resume, set version, reset prefix cache)
  must be answered within it. A server that misses it is SET ASIDE: marked down and handed to the pool's `on_dead`
  (the client restarts or replaces it; it gets the current weights and version before it serves again), logged once,
  while the call goes on with the others. If every server called misses it, the call fails (EngineError naming them).
- `timeout_s` (engine.control_timeout_s): a call that may be slow, a weight reload above all (a 235B model reloads for
  minutes), is bounded by it, but the server must keep answering a liveness probe (`liveness_path`, answered by its
  HTTP front while it loads) within `deadline_s`: a server that stops answering is set aside after about
  `deadline_s`, however long `timeout_s` is (and one still loading at `timeout_s` is set aside then). Calls to one
  named server (a join, a restart, an rpc) use it too and fail instead of setting aside: their caller decides.

A pool-wide call never reaches a server whose Ray node is known dead: it is set aside before the call. A server that
failed otherwise (connection refused, an HTTP error) is dropped from the call when its process (or engine host, or
node) is gone (`_drop_dead`, which asks within `deadline_s`); a live server that failed still fails the call.

The shapes of the calls come from the engine kind (base.py `EngineKind.*_call`); the servers, their states and the
membership lock from the pool (pool.py); a sync records what it loaded in the pool's `weights` (served.py). engine=sim
runs this same fan-out, deadlines and set-aside included, and only delivers each call in process (sim.py
`SimControl.deliver`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import aiohttp

from fully_async.aio import NamedLock, bounded
from fully_async.engines.auth import auth_headers
from fully_async.engines.base import EngineKind
from fully_async.engines.call_log import CallLog
from fully_async.engines.errors import EngineError
from fully_async.engines.served import ServedWeights
from fully_async.engines.set_aside import Unanswered, drop_dead, set_aside, set_aside_lost, set_aside_unanswered
from fully_async.engines.slots import Slots, SlotState
from fully_async.engines.types import EngineState, HttpCall, PauseMode

logger = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0
"""While a slow call runs, a server that answered its liveness probe is probed again after this many seconds."""


@runtime_checkable
class ControlledPool(Protocol):
    """What the control plane reads of its pool (pool.py `EngineServers`), and nothing more."""

    kind: EngineKind
    state: EngineState
    slots: Slots
    procs: list[Any]
    weights: ServedWeights

    @property
    def membership(self) -> NamedLock: ...
    @property
    def live(self) -> list[int]: ...
    @property
    def serving(self) -> list[int]: ...
    def address(self, index: int) -> str: ...
    def is_alive(self, index: int) -> bool: ...
    def log_for(self, url: str) -> str: ...
    def node_of(self, index: int) -> dict[str, Any]: ...
    def on_lost_nodes(self, indices: list[int]) -> list[int]: ...
    def server_died(self, index: int) -> None: ...
    async def sync_router_async(self) -> None: ...


async def call_one(session: aiohttp.ClientSession, url: str, call: HttpCall) -> Any:
    """`call` on the server at `url`: its JSON answer (or text); EngineError on an HTTP error, a broken
    connection, or an answer the call's `check` refuses."""
    try:
        async with session.request(call.method, url + call.path, params=call.params, json=call.json) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise EngineError(f"HTTP {resp.status}: {text[:300]}")
    except aiohttp.ClientError as e:
        raise EngineError(f"{call.method} {call.path}: {type(e).__name__}: {e}") from e
    try:
        body = json.loads(text) if text.strip() else None
    except ValueError:
        body = text  # a plain-text answer (SGLang's /flush_cache); `check` may read it
    if call.check is not None and (err := call.check(body)):
        raise EngineError(err)
    return body


class ControlPlane:
    """Control calls on the serving servers of `pool` (an `EngineServers`): pool-wide ones within `deadline_s`,
    slow ones (reloads) within `timeout_s` while the server answers a liveness probe within `deadline_s`."""

    def __init__(self, pool: ControlledPool, deadline_s: float, timeout_s: float | None = None) -> None:
        self.pool = pool
        self.deadline_s = deadline_s
        self.timeout_s = deadline_s if timeout_s is None else timeout_s
        self.calls = CallLog()

    # ---- pool-wide operations ----------------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort", idle: Callable[[], bool] | None = None) -> bool:
        """abort: in-flight requests return their tokens so far (the client continues them after resume);
        recompute: they freeze, their KV dropped, and are prefilled again at the resume; keep: they freeze with their
        KV and go on after the resume (engines/inflight.py). The clients in this process hold new requests from the first
        line on. `idle`: asked right then; when it says no request is in flight on any server, the servers are not
        called: nothing runs that could be aborted or frozen, and nothing reaches them before the resume (a
        server's own pause costs a round trip and, on vLLM, a fixed 20 ms wait; it is the sync's largest part on a
        small model). Returns whether the servers were paused."""
        state = self.pool.state
        state.set_paused(True)
        state.clients_only = idle is not None and idle()
        if not state.clients_only:
            await self.call_all("pause", self.pool.kind.pause_call(mode))
        state.cache_kept = mode == "keep" and not state.clients_only
        return not state.clients_only

    async def resume(self) -> None:
        """Resume the servers (unless the pause held only the clients), then the clients."""
        if not self.pool.state.clients_only:
            await self.call_all("resume", self.pool.kind.resume_call())
        self.pool.state.clients_only = self.pool.state.cache_kept = False
        self.pool.state.set_paused(False)

    async def set_version(self, version: int) -> None:
        """Label every serving server's next tokens with `version`. The caller holds the pool's membership lock."""
        await self.call_all("set version", self.pool.kind.set_version_call(version))
        self.pool.state.version = version

    async def reset_prefix_cache(self) -> None:
        await self.call_all("reset prefix cache", self.pool.kind.reset_prefix_cache_call())

    async def _reset_after_sync(self, what: str) -> None:
        """After new weights: KV blocks cached under the old ones must not serve new prompts. Under a keep pause the
        frozen requests hold their blocks and the reset cannot run; their cache salts keep the versions apart
        (engines/inflight.py), so it is skipped, not tried and failed."""
        if self.pool.state.cache_kept:
            return
        try:
            await self.reset_prefix_cache()
        except EngineError as e:  # a request the pause did not freeze (another process's) may still hold blocks
            logger.warning("prefix cache not reset after %s: %s", what, e)

    async def reset_encoder_cache(self) -> None:
        """A vision-language server's cached image encoder outputs, after new weights (the kind's call says why)."""
        call = self.pool.kind.encoder_cache_reset_call()
        if call is not None:
            await self.call_all("reset encoder cache", call)

    async def is_paused(self, url: str) -> bool:
        return await self.pool.kind.is_paused(url, self)

    async def rpc(self, url: str, method: str, spec: str, timeout_s: float) -> list[Any]:
        """`method(spec)` on every worker of the server at `url`, within `timeout_s`; the workers' answers."""
        (body,) = await self.call_all(method, self.pool.kind.rpc_call(method, spec), [url], timeout_s=timeout_s)
        return (body or {}).get("results", body)

    async def rpc_all(self, method: str, spec: str) -> dict[str, Any]:
        """`method(spec)` on every worker of every serving server at once, each server within `deadline_s`:
        {url: the workers' answers, or the EngineError of a server that failed or did not answer}. Nobody is set
        aside: the caller judges the answers (a weight sync's proof, fully_async/weights/verify.py)."""
        await set_aside_lost(self.pool, method, self.deadline_s)
        urls = [self.pool.address(i) for i in self.pool.serving]
        call = self.pool.kind.rpc_call(method, spec)
        async with self.session() as session:
            bodies = await asyncio.gather(*(self._one(session, url, call, self.deadline_s, False) for url in urls),
                                          return_exceptions=True)  # fmt: skip
        return {url: b if isinstance(b, Exception) else (b or {}).get("results", b) for url, b in zip(urls, bodies)}

    async def reload(self, weights_dir: Path, node_dirs: dict[str, Path], procs: list[Any], nodes: list[Any]) -> None:
        """Reload the servers `procs` (in the pool or about to join it), each on its node in `nodes` from that node's
        copy in `node_dirs` when it has one, else from `weights_dir`, all at once; any failure fails the call (a
        slow call: `timeout_s`, with the liveness probe)."""
        calls = self._reload_calls(weights_dir, node_dirs, [p.url for p in procs], nodes)
        await self.fan_out("reload weights", calls, self.timeout_s, slow=True, pool_wide=False)

    def _reload_calls(self, weights_dir: Path, node_dirs: dict[str, Path], urls: list[str], nodes: list[Any]):
        return [
            (url, self.pool.kind.reload_weights_call(node_dirs.get(node, weights_dir)))
            for url, node in zip(urls, nodes)
        ]

    # ---- weight syncs ------------------------------------------------------------------------------------------------
    async def load_weights(
        self, weights_dir: str | Path, version: int, node_dirs: dict[str, str | None] | None = None
    ) -> dict[str, Any]:
        """The reload of `EngineServers.load_weights`, the innermost of three `load_weights` (the engine port's in
        service.py, the pool's in pool.py, this one, which sends the control calls): every serving server reloads
        (stale ones included, so they serve again), the directory and its node copies become the pool's
        `weights.directory` and `weights.node_dirs` (what a server that comes back reloads), the prefix caches are
        reset and the version set, all under the pool's membership lock. A node mapped to None in `node_dirs` got no
        copy of this version (the disk transport abandoned it): its servers are set aside.
        Returns {url: its workers' answers to the reload} of the servers that reloaded (vLLM: each worker's digest
        of what its loader took, the proof of the sync without another round trip, weights/verify.py)."""
        pool = self.pool
        weights_dir = Path(weights_dir).resolve()
        async with pool.membership:
            routed = await self.route_copies("reload weights", node_dirs)
            answers = await self._reload_serving(weights_dir, routed)
            pool.weights.directory, pool.weights.node_dirs = weights_dir, routed
            rejoin = bool(pool.slots.count(SlotState.STALE))
            pool.slots.sync_reached()  # every server in the pool, stale ones included, holds this version now
            await self._reset_after_sync("a weight reload")
            await self.reset_encoder_cache()
            await self.set_version(version)
            if rejoin:
                await pool.sync_router_async()
        return answers

    async def route_copies(self, what: str, node_dirs: dict[str, str | None] | None) -> dict[str, Path]:
        """Before a pool-wide load from files (weights, an adapter): {node: its copy} of the nodes in `node_dirs`
        that got one (disk.py `distribute`); the serving servers on a node mapped to None (its copy was abandoned),
        or on a node Ray reports dead, are set aside. The caller holds the membership lock."""
        node_dirs = node_dirs or {}
        abandoned = {node for node, d in node_dirs.items() if d is None}
        if abandoned:
            pool = self.pool
            set_aside(self.pool, what, [i for i in pool.serving if pool.node_of(i)["node_id"] in abandoned],
                           "the copy to its node was abandoned")  # fmt: skip
            await pool.sync_router_async()
        await set_aside_lost(self.pool, what, self.deadline_s)
        return {node: Path(d) for node, d in node_dirs.items() if d is not None}

    async def weights_received(self, version: int, epoch: int) -> None:
        """`EngineServers.weights_received`: the version without a reload; stale servers serve again only when the
        weight group that reached every server was formed at the pool's current `weights.epoch`; the pool's
        `weights.directory` becomes None (a server that comes back waits as stale for the next sync)."""
        pool = self.pool
        pool.weights.directory = None  # the latest weights are in no directory: a restart must wait for the next sync
        await self._reset_after_sync("a weight sync")
        await self.reset_encoder_cache()  # a trained vision tower's outputs change too
        async with pool.membership:
            await self.set_version(version)
        if epoch == pool.weights.epoch and pool.slots.count(SlotState.STALE):
            pool.slots.sync_reached()
            await pool.sync_router_async()

    async def _reload_serving(self, weights_dir: Path, node_dirs: dict[str, Path]) -> dict[str, Any]:
        """Reload every serving server, pool-wide (after `route_copies`, which set aside those on lost nodes): one that
        stops answering is set aside, one that died meanwhile is dropped. {url: its answer's `results`} of the rest."""
        indices = self.pool.serving
        nodes = [self.pool.node_of(i)["node_id"] if node_dirs else None for i in indices]
        urls = [self.pool.address(i) for i in indices]
        calls = self._reload_calls(weights_dir, node_dirs, urls, nodes)
        bodies = await self.fan_out("reload weights", calls, self.timeout_s, slow=True, pool_wide=True)
        return {url: (b or {}).get("results", b) for url, b in zip(urls, bodies) if b is not None}

    async def reload_indices(self, weights_dir: Path, node_dirs: dict[str, Path], indices: list[int]) -> None:
        """Reload the pool's servers `indices`, each from its node's copy in `node_dirs` when it has one, else
        `weights_dir`."""
        nodes = [self.pool.node_of(i)["node_id"] if node_dirs else None for i in indices]
        await self.reload(weights_dir, node_dirs, [self.pool.procs[i] for i in indices], nodes)

    # ---- the fan-out -------------------------------------------------------------------------------------------------
    async def call_all(
        self, what: str, call: HttpCall, urls: list[str] | None = None, timeout_s: float | None = None
    ) -> list[Any]:
        """Run `call` on every server in `urls` at once, each within `timeout_s` (default `deadline_s`); any failure
        fails the call. `urls` None: every serving server of the pool, pool-wide (see the module docstring: servers
        on a lost node are not called, those that miss `deadline_s` are set aside, dead ones dropped). The answers,
        in the order of the servers called (None for one set aside or dropped)."""
        pool_wide = urls is None
        if pool_wide:
            await set_aside_lost(self.pool, what, self.deadline_s)
            urls = [self.pool.address(i) for i in self.pool.serving]
        return await self.fan_out(what, [(url, call) for url in urls], timeout_s or self.deadline_s,
                                  pool_wide=pool_wide)  # fmt: skip

    async def fan_out(
        self, what: str, calls: list[tuple[str, HttpCall]], bound_s: float, slow: bool = False, pool_wide: bool = False
    ) -> list[Any]:
        """Each (url, call) at once, within `bound_s` (and, when `slow`, while the server answers its liveness probe
        within `deadline_s`). `pool_wide`: a server that does not answer is set aside and a dead one dropped (see the
        module docstring); otherwise any failure fails the call: EngineError naming each failed server and its log."""
        pool = self.pool
        async with self.session() as session:
            results = await asyncio.gather(*(self._one(session, url, call, bound_s, slow) for url, call in calls),
                                           return_exceptions=True)  # fmt: skip
        urls = [url for url, _ in calls]
        if pool_wide:
            results = await set_aside_unanswered(self.pool, what, urls, results)
            results = await drop_dead(self.pool, what, urls, results, self.deadline_s)
        failed = [f"{url}: {r} (log: {pool.log_for(url)})" for url, r in zip(urls, results) if isinstance(r, Exception)]
        if failed:
            raise EngineError(
                f"{pool.kind.name} {what} failed on {len(failed)} of {len(urls)} servers: " + "; ".join(failed)
            )
        return results

    def session(self) -> Any:
        """The HTTP session of one fan-out (no total timeout of its own: `_one` bounds each call)."""
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), headers=auth_headers())

    async def _one(self, session: Any, url: str, call: HttpCall, bound_s: float, slow: bool) -> Any:
        record = self.calls.started(url, f"{call.method} {call.path}")
        try:
            if slow:
                answer = await self._watched(session, url, call, bound_s)
            else:
                answer = await bounded(self.deliver(session, url, call), bound_s)
        except TimeoutError as e:
            self.calls.ended(record, "unanswered")
            raise Unanswered(f"no answer to {call.method} {call.path} within {self._bound_name(bound_s)}") from e
        except BaseException as e:
            self.calls.ended(record, type(e).__name__)
            raise
        self.calls.ended(record, "ok")
        return answer

    def recent_calls(self) -> str:
        """Each server's last control calls (engines/call_log.py), for the error of a sync that passed its timeout."""
        return self.calls.text()

    def _bound_name(self, bound_s: float) -> str:
        if bound_s == self.deadline_s:
            return f"engine.control_deadline_s={bound_s:g}s"
        if bound_s == self.timeout_s:
            return f"engine.control_timeout_s={bound_s:g}s"
        return f"{bound_s:g} s"

    async def _watched(self, session: Any, url: str, call: HttpCall, bound_s: float) -> Any:
        """`call` within `bound_s`, while the server answers a liveness probe within `deadline_s`: Unanswered as soon
        as one probe goes unanswered (the server, or its node, stopped), whatever is left of `bound_s`."""
        work = asyncio.ensure_future(bounded(self.deliver(session, url, call), bound_s))
        watch = asyncio.ensure_future(self._watch(session, url, call))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            return work.result() if work in done else watch.result()
        finally:
            for task in (work, watch):
                task.cancel()
            # Bounded too: a task that ignored its cancellation must not hold the call (it did, issue 46).
            _, left = await asyncio.wait({work, watch}, timeout=self.deadline_s)
            if left:
                logger.error("%s %s on %s: %d of its tasks still run %g s after their cancellation; left behind",
                             call.method, call.path, url, len(left), self.deadline_s)  # fmt: skip

    async def _watch(self, session: Any, url: str, call: HttpCall) -> None:
        """Probe the server at `url` until cancelled; Unanswered when a probe is not answered within `deadline_s`."""
        probe = HttpCall("GET", self.pool.kind.liveness_path)
        while True:
            try:
                await bounded(self.deliver(session, url, probe), self.deadline_s)
            except EngineError:
                pass  # an answer, even an error, shows a live front; a refused connection fails the call itself
            except TimeoutError as e:
                raise Unanswered(f"no answer to the liveness probe GET {probe.path} within "
                                 f"{self._bound_name(self.deadline_s)} while {call.method} {call.path} ran") from e  # fmt: skip
            await asyncio.sleep(PROBE_EVERY_S)

    async def deliver(self, session: Any, url: str, call: HttpCall) -> Any:
        """`call` on the server at `url` (unbounded: the fan-out bounds it)."""
        return await self.call_one(session, url, call)

    call_one = staticmethod(call_one)  # the module's, as the plane's own: the warm-up sends through it
