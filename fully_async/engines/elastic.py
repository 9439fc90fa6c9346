"""Elastic changes to an engine pool while the run goes on: servers join (`join`) and leave (`leave`).

A joining server serves only once it holds the current weights and version (what the pool's `weights` names,
served.py; loaded under the pool's membership lock, so a sync never interleaves), or waits out of rotation as STALE
when those weights exist in no directory. A leaving server is retired first (no new requests, out of the router), then
what it still runs is aborted (the client continues it on the others), and only then is it stopped and its host
freed. Both change the weight group's epoch (`weights.epoch`): a weight group that spans the old members must be
re-formed. `fully_async.ctl engines` drives them through the Rollouter (service.py); docs/elastic.md tells the whole
story. A server that died comes back through `relaunch`: in place, or replaced on a new engine host when its host (or
the host's node) is gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol, runtime_checkable

from fully_async.aio import NamedLock
from fully_async.config import EngineConfig
from fully_async.engines.base import EngineKind
from fully_async.engines.control import ControlPlane
from fully_async.engines.errors import EngineError
from fully_async.engines.hung import wait_for_host
from fully_async.engines.process import REPLACED_GRACE_S, ServerProcess, node_of
from fully_async.engines.served import ServedWeights
from fully_async.engines.slots import Slots, SlotState
from fully_async.engines.types import EngineState
from fully_async.engines.warmup import WarmupPlan, warm

logger = logging.getLogger(__name__)


@runtime_checkable
class ElasticPool(Protocol):
    """What joins, leaves and comebacks read and change of the pool (pool.py `EngineServers`): its members, their
    weights (what they must load: `weights`, served.py) and hosts; the pool's own fields, since membership is what
    this room changes."""

    kind: EngineKind
    cfg: EngineConfig
    state: EngineState
    slots: Slots
    procs: list[Any]
    control: ControlPlane
    weights: ServedWeights
    hosts: list[Any] | None
    host_factory: Any
    warmup: WarmupPlan | None
    pool_events: list[tuple[str, int, str, str | None]]
    closed: bool

    @property
    def membership(self) -> NamedLock: ...
    def new_process(self, index: int, port: int | None = None, host: Any = None) -> Any: ...
    def node_of(self, index: int) -> dict[str, Any]: ...
    def node_dead(self, index: int) -> bool: ...
    def replaceable(self, index: int) -> bool: ...
    def retire(self, index: int) -> None: ...
    async def sync_router_async(self) -> None: ...


async def join(pool: ElasticPool, count: int) -> list[int]:
    """Start `count` more servers of `pool` at once (each on a new engine host from `host_factory` when the job placed
    the servers through Ray, else as child processes), load the current weights and version into them, and only then
    append them to the pool (the client picks them up from there): their first tokens carry the current version.
    Returns their indices. Servers that fail to start are stopped and their hosts freed; EngineError names them after
    the others joined. The caller serialises calls (`EngineServers.add`)."""
    base = len(pool.procs)
    if pool.hosts is not None and pool.host_factory is None:
        raise EngineError("this engine pool cannot grow: its servers were placed without a host factory")
    results = await asyncio.gather(*(_start_one(pool, base + k) for k in range(count)), return_exceptions=True)
    started = [r for r in results if not isinstance(r, BaseException)]
    joined: list[int] = []
    async with pool.membership:
        urls = [p.url for p in started]
        weights = pool.weights
        if urls:
            if weights.directory is not None:
                nodes = [node_of(p)["node_id"] if weights.node_dirs else None for p in started]
                await pool.control.reload(weights.directory, weights.node_dirs, started, nodes)
            if weights.adapters is not None:
                await weights.adapters.bring_current(started)
            await pool.control.call_all("set version", pool.kind.set_version_call(pool.state.version), urls)
            if pool.state.paused and not pool.state.clients_only:  # joined during a sync: paused like the others
                await pool.control.call_all("pause", pool.kind.pause_call("abort"), urls)
        # The current weights in no directory (collective transport): it serves from the next sync on, which
        # re-forms the weight group with it (the epoch says the members changed).
        state = SlotState.STALE if weights.stale_on_return else SlotState.SERVING
        for proc in started:
            pool.procs.append(proc)
            joined.append(pool.slots.append(state))
            pool.pool_events.append(("join", joined[-1], proc.url, None))
        if started:
            weights.epoch += 1
    await pool.sync_router_async()
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise EngineError(
            f"{len(failed)} of {count} new {pool.kind.name} servers did not start ({len(joined)} joined): "
            + "; ".join(f"{type(e).__name__}: {e}" for e in failed)
        )
    return joined


async def _start_one(pool: ElasticPool, index: int) -> ServerProcess:
    """Launch server `index` (on a new engine host when the pool's servers have hosts) and wait until healthy; on
    failure stop it and free its host."""
    host = None
    if pool.hosts is not None:
        host = await asyncio.to_thread(pool.host_factory.create, index)
    proc = pool.new_process(index, host=host)
    try:
        await asyncio.to_thread(proc.launch)
        await asyncio.to_thread(proc.wait_healthy, pool.cfg.startup_timeout_s)
        await warm(pool, [proc], pool.warmup)  # before it joins: its first requests cost what steady ones do
    except BaseException:
        await asyncio.to_thread(proc.stop)
        if host is not None:
            pool.host_factory.release(host)
            pool.host_factory.release_slot(index)
        raise
    return proc


async def leave(pool: ElasticPool, index: int, drained: Any = None) -> None:
    """Take server `index` out of `pool`: the caller has stopped sending to it; abort what it still runs (the client
    continues those requests elsewhere), wait for `drained()` (an awaitable factory: the client's requests on it are
    done), stop it and free its host."""
    url = pool.procs[index].url
    async with pool.membership:
        pool.retire(index)
        pool.weights.epoch += 1  # a weight group that spans it must be re-formed without it
    await pool.sync_router_async()  # before the abort: the router must not send the continuations back to it
    try:
        await pool.control.call_all("pause", pool.kind.pause_call("abort"), [url])
    except EngineError as e:  # a dead server has nothing to abort
        logger.warning("aborting the requests of %s on removal: %s", url, e)
    if drained is not None:
        await drained()
    proc = pool.procs[index]
    await asyncio.to_thread(proc.stop)
    if pool.host_factory is not None and getattr(proc, "host", None) is not None:
        pool.host_factory.release(proc.host)
    pool.pool_events.append(("leave", index, url, None))


async def bring_current(pool: ElasticPool, indices) -> None:
    """Servers `indices` of `pool`, healthy again (started or restarted): the current weights (or STALE where their
    node has no copy yet), the current adapter (adapter syncs), the current version, and paused when the pool is."""
    urls = [pool.procs[i].url for i in indices]
    weights = pool.weights
    if weights.directory is not None:
        try:
            await pool.control.reload_indices(weights.directory, weights.node_dirs, list(indices))
        except EngineError as e:
            # Multi-node disk weights: a server replaced onto a node that has no copy yet cannot read the
            # trainer's directory. It waits out of rotation (stale) for the next sync, which copies to its node.
            uncopied = [i for i in indices if weights.node_dirs and pool.node_of(i)["node_id"] not in weights.node_dirs]
            if not uncopied:
                raise
            logger.warning("servers %s have no copy of the weights on their node yet (%s); they serve from the "
                           "next sync on", [pool.procs[i].url for i in uncopied], e)  # fmt: skip
            for i in uncopied:
                pool.slots.mark_stale(i)
            weights.epoch += 1
    if weights.adapters is not None:  # the current adapter, from its node's copy where there is one
        await weights.adapters.bring_current([pool.procs[i] for i in indices])
    await pool.control.call_all("set version", pool.kind.set_version_call(pool.state.version), urls)
    if pool.state.paused and not pool.state.clients_only:  # back during a sync: paused like the others
        await pool.control.call_all("pause", pool.kind.pause_call("abort"), urls)


def came_back(pool: ElasticPool, index: int) -> None:
    """Server `index`, restarted and brought current, serves again; or, where the current weights are in no directory
    (collective transport), waits as STALE for the next sync. A server that was down may have missed a weight group
    formed meanwhile without it: the epoch moves, so the next sync re-forms the group with it (else that group's
    "every server received it" would clear a mark it never reached)."""
    was_down = pool.slots[index] is SlotState.DOWN
    pool.slots.back_up(index, stale=pool.weights.stale_on_return)
    if was_down and pool.slots[index] is SlotState.STALE:
        pool.weights.epoch += 1


def relaunch(pool: ElasticPool, index: int) -> None:
    """Start server `index` of `pool` again and wait until healthy (weights not loaded yet). A server whose engine
    host is gone (its node lost) gets a new host from `host_factory`, on whatever node has room: a new address."""
    proc = pool.procs[index]
    pool.weights.epoch += 1  # its workers are new processes: any weight group it was in is gone
    if pool.weights.stale_on_return and pool.slots[index] is SlotState.SERVING:
        pool.slots.mark_stale(index)  # it comes back on its start-up weights; the next sync brings it up to date
    verdict = host_verdict(pool, index) if pool.replaceable(index) else "alive"
    if verdict != "alive":
        # A hung node that Ray keeps alive still shows its resources free: its replacement goes elsewhere.
        _replace(pool, index, avoid=proc.node["node_id"] if verdict == "hung" else None)
        return
    proc.stop(grace_s=REPLACED_GRACE_S)
    proc.launch()
    proc.wait_healthy(pool.cfg.startup_timeout_s)


def host_verdict(pool: ElasticPool, index: int) -> str:
    """Whether the engine host of server `index` is alive, gone, or hung past engine.hung_host_s (engines/hung.py)."""
    cfg = pool.cfg
    return wait_for_host(pool.procs[index], lambda: pool.node_dead(index), cfg.control_deadline_s, cfg.hung_host_s,
                         closed=lambda: pool.closed)  # fmt: skip


def _replace(pool: ElasticPool, index: int, avoid: str | None = None) -> None:
    old = pool.procs[index]
    # The old host first: a hung one that continues later must not run a server nobody sends to (its server dies
    # with it, through the watchdog's lifeline). A failed replacement is tried again from here: the killed host is
    # then reported gone at once.
    pool.host_factory.release(old.host)
    host = pool.host_factory.create(index, avoid_node=avoid)
    proc = pool.new_process(index, host=host)
    try:
        proc.launch()
        proc.wait_healthy(pool.cfg.startup_timeout_s)
    except BaseException:
        proc.stop()
        pool.host_factory.release(host)
        raise
    pool.procs[index] = proc
    pool.pool_events.append(("replace", index, old.url, proc.url))
    logger.warning("engine server %s (host lost or hung) replaced by %s", old.url, proc.url)
