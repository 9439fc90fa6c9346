"""The lifetime of a pool's servers: every one launched early (not waited for), started (launched, healthy, current,
warmed, behind the router), every one stopped, one restarted in place or on a new host. Behind `EngineServers.launch`,
`start`, `stop`, `restart` and `restart_async` (pool.py); joins, leaves and the relaunch of one server are elastic.py's.

Emulated engines (a kind `in_process`, engine=sim) launch and stop nothing: a restart starts the emulated engine
afresh at the current version, serving at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fully_async.aio import NamedLock
from fully_async.config import EngineConfig
from fully_async.engines.base import EngineKind
from fully_async.engines.elastic import bring_current, came_back
from fully_async.engines.process import ServerProcess, release_shm, shm_record
from fully_async.engines.slots import Slots
from fully_async.engines.types import EngineState
from fully_async.engines.warmup import WarmupPlan, warm


@runtime_checkable
class LifecyclePool(Protocol):
    """What starting, stopping and restarting read and set of the pool (pool.py `EngineServers`)."""

    kind: EngineKind
    cfg: EngineConfig
    state: EngineState
    slots: Slots
    procs: list[Any]
    run_dir: Path
    warmup: WarmupPlan | None
    started_at: dict[str, tuple[float, float]]
    router: Any
    host_factory: Any
    closed: bool

    @property
    def membership(self) -> NamedLock: ...
    def routed_urls(self) -> list[str]: ...
    def relaunch(self, index: int) -> None: ...
    def sync_router(self) -> None: ...
    async def sync_router_async(self) -> None: ...
    def stop(self) -> None: ...


def launch(pool: LifecyclePool) -> None:
    """Launch every server without waiting for it (`start` waits), so the caller can prepare what needs no server
    (the tokenizer, the warm-up plan) while they come up; a second call, or `start` after it, launches nothing more.
    A failure stops what started."""
    if pool.kind.in_process or "engine_launch" in pool.started_at:
        return
    launched = time.time()
    pool.started_at["engine_launch"] = (launched, launched)  # its end: every server healthy and current (`start`)
    try:
        for p in pool.procs:
            p.launch()
    except BaseException:
        pool.stop()  # a half-launched pool would hold memory and cores until interpreter exit
        raise


def start(pool: LifecyclePool) -> None:
    """Launch every server (unless `launch` did) and block until all are healthy and current (EngineError with the
    log tail otherwise), warm them, then start the router in front of them. A failure stops what started."""
    if pool.kind.in_process:  # emulated engines: nothing to launch
        return
    launch(pool)
    try:
        for p in pool.procs:
            p.wait_healthy(pool.cfg.startup_timeout_s)
        run_sync(bring_current(pool, range(len(pool.procs))))
        pool.started_at["engine_launch"] = (pool.started_at["engine_launch"][0], time.time())
        run_sync(warm(pool, pool.procs, pool.warmup))
        pool.started_at["engine_warmup"] = (pool.started_at["engine_launch"][1], time.time())
        pool.router = pool.kind.make_router(pool.run_dir)
        if pool.router is not None:
            pool.router.start(pool.routed_urls(), pool.cfg.startup_timeout_s)
    except BaseException:
        pool.stop()  # a half-started pool would hold memory and cores until interpreter exit
        raise


def stop(pool: LifecyclePool) -> None:
    """Stop every launched server (and its children) and free the hosts made for added or replaced ones; safe to
    call twice."""
    pool.closed = True
    if pool.kind.in_process:
        return
    if pool.router is not None:
        pool.router.stop()  # first: no request should reach a server that is going away
    for p in pool.procs:
        p.stop()
        if p.log_path is not None:  # a server whose host died with its node left its record: on this machine,
            release_shm(shm_record(p.log_path))  # its files go now (process.py)
    if pool.host_factory is not None:
        pool.host_factory.close()


def restart(pool: LifecyclePool, index: int) -> None:
    """Restart server `index` with the latest weights and version (replaced on another node when its engine host is
    gone; see `elastic.relaunch`). Blocks until healthy."""
    if pool.kind.in_process:  # an emulated engine holds the current (emulated) weights at once
        pool.kind.restart_in_process(index, pool.state.version)
        pool.slots.back_up(index, stale=False)
        return
    pool.relaunch(index)
    run_sync(warm(pool, [pool.procs[index]], pool.warmup))
    run_sync(bring_current(pool, [index]))
    came_back(pool, index)
    pool.sync_router()


async def restart_async(pool: LifecyclePool, index: int) -> None:
    """`restart` from the event loop that runs the control plane: the launch in a thread, the weights and version
    under `membership`, so a sync's reload and version never interleave with it."""
    if pool.kind.in_process:
        restart(pool, index)
        return
    await asyncio.to_thread(pool.relaunch, index)
    await warm(pool, [pool.procs[index]], pool.warmup)  # down still: out of rotation, outside the lock
    async with pool.membership:
        await bring_current(pool, [index])
        came_back(pool, index)
    await pool.sync_router_async()  # back (or replaced at a new address): the router sends to it again


def server_process(kind: EngineKind, run_dir: Path, index: int, host: Any = None, port: int | None = None):
    """Server `index` of `kind` as a process: under engine host `host` on its node (engines/host.py), else a child
    of this process listening on `port` (None: a free one); its log under `run_dir`/engines."""
    name, log_path = f"{kind.name}-{index}", run_dir / "engines" / f"{kind.name}-{index}.log"
    if host is not None:
        from fully_async.engines.host import RemoteServer

        return RemoteServer(
            name, host, lambda port, bind: kind.command(index, port, bind),
            kind.environment(index), log_path, kind.health_path,
        )  # fmt: skip
    return ServerProcess(
        name=name,
        command=lambda port: kind.command(index, port, kind.local_bind),
        env=kind.environment(index),
        log_path=log_path,
        host=kind.local_bind,
        health_path=kind.health_path,
        port=port,
    )


def run_sync(coro) -> None:
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
