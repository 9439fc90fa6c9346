"""Bringing dead engine servers back while generation goes on: the client's side of a server failure.

A generate request that failed on a server asks `Recovery.on_failure`: is the server dead? Then it is marked down in
the pool (no request and no pool-wide control call goes to it, the router drops it) and restarted in the background,
or replaced on another node when its engine host is gone, trying again every engine.replace_retry_s until one has
room (engine.auto_restart). Behind a router the failed request's server is unknown: a dead router is started again
and every server is looked at. A control call that finds a server dead hands it here too (`EngineServers.on_dead`).

One death, two lines: "engine server ... died" when the first request finds it dead, and "... is back" when it
serves again, with the count of requests that failed on it meanwhile (every request it held fails at once: 32 lines
for one server before). The requests themselves retry on the others without a line each.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fully_async.config import EngineConfig
from fully_async.engines.slots import Slots, SlotState

logger = logging.getLogger(__name__)


@runtime_checkable
class RecoveredPool(Protocol):
    """What a recovery reads of the pool (pool.py `EngineServers`) and asks it to do: restart a server, the router."""

    cfg: EngineConfig
    slots: Slots
    router: Any
    closed: bool

    @property
    def live(self) -> list[int]: ...
    @property
    def serving(self) -> list[int]: ...
    def address(self, index: int) -> str: ...
    def is_alive(self, index: int) -> bool: ...
    def log_path(self, index: int) -> Path | None: ...
    async def restart_async(self, index: int) -> None: ...
    def restart_router(self) -> None: ...
    async def sync_router_async(self) -> None: ...


class Recovery:
    """Restarts (or replaces) the dead servers of `servers` (an `EngineServers`), once each, in the background;
    counts them in `stats.restarts`."""

    def __init__(self, servers: RecoveredPool, auto_restart: bool, stats: Any) -> None:
        self.servers = servers
        self.auto_restart = auto_restart
        self.stats = stats
        self._restarts: dict[int, asyncio.Task] = {}
        self._router_restart: asyncio.Future | None = None
        self.failed_tries = 0
        """Restarts or replacements that failed and were tried again (each logged once)."""
        self.lost_requests: dict[int, int] = {}
        """Per server found dead: the requests that failed on it since (said in its "is back" line)."""

    def close(self) -> None:
        for task in self._restarts.values():
            task.cancel()

    def _retired(self, idx: int) -> bool:
        return self.servers.slots[idx] is SlotState.RETIRED

    async def wait_for_a_server(self) -> None:
        """When every server in the pool is down and some are being restarted or replaced, wait for the first to come
        back (up to engine.startup_timeout_s) instead of spending the retries on dead servers."""
        slots = self.servers.slots
        if self._restarts and all(slots[i] is SlotState.DOWN for i in self.servers.live):
            await asyncio.wait(list(self._restarts.values()), timeout=self.servers.cfg.startup_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip

    async def on_failure(self, idx: int) -> bool:
        """A request failed on server `idx` (or, behind a router, somewhere). True when the server is dead: the
        failure is counted in its death's lines, so the caller need not log it."""
        if self.servers.router is not None:
            await self._on_routed_failure()
            return False
        return await self._check_dead(idx)

    async def _on_routed_failure(self) -> None:
        """Behind a router the failed request's server is unknown (the router picked it): a dead router is started
        again; every server in the pool is looked at, and the dead ones are marked down (out of the router) and
        restarted."""
        for _ in range(6):  # a killed process's socket closes a moment before it can be reaped: look twice
            if not self.servers.router.is_alive():
                if self._router_restart is None or self._router_restart.done():
                    self._router_restart = asyncio.get_running_loop().create_task(
                        asyncio.to_thread(self.servers.restart_router)
                    )
                try:
                    await asyncio.shield(self._router_restart)
                except Exception:  # the retry meets the failure again and, past engine.max_retries, fails with it
                    logger.exception("restarting the engine router failed")
                break
            await asyncio.sleep(0.05)
        for i in self.servers.serving:
            if not await asyncio.to_thread(self.servers.is_alive, i):
                await self._check_dead(i)

    async def _check_dead(self, idx: int) -> bool:
        """Whether server `idx` is dead; the first request to find it so logs its death and schedules its restart."""
        if self._retired(idx):
            return False  # it left the pool on purpose: nothing to restart
        if not self._is_down(idx):
            # A killed server's socket closes a moment before its process can be reaped: look twice before calling it
            # live.
            for _ in range(6):
                # In a thread: for a server on another node this asks its engine host (a Ray call).
                if not await asyncio.to_thread(self.servers.is_alive, idx):
                    break
                await asyncio.sleep(0.05)
            else:
                return False  # a live server that misbehaved: just avoid it for this retry
        if self._is_down(idx):  # already found dead (by a request that failed beside this one, or a control call)
            self.lost_requests[idx] = self.lost_requests.get(idx, 0) + 1
            return True
        self.lost_requests[idx] = 1
        logger.error("engine server %s died; log %s; its requests go on on the others", self.servers.address(idx),
                     self.servers.log_path(idx))  # fmt: skip
        self.schedule_restart(idx)
        await self.servers.sync_router_async()  # out of the router until it is back
        return True

    def _is_down(self, idx: int) -> bool:
        return self.servers.slots[idx] is SlotState.DOWN

    def schedule_restart(self, idx: int) -> None:
        """Mark server `idx` down and restart (or replace) it in the background, once, when engine.auto_restart
        allows it."""
        self.servers.slots.mark_down(idx)
        if self.auto_restart and idx not in self._restarts and not self._retired(idx):
            self._restarts[idx] = asyncio.get_running_loop().create_task(self._restart(idx))

    async def _restart(self, idx: int) -> None:
        """Restart server `idx` in place; when its engine host (or the host's node) is gone, or hung past
        engine.hung_host_s (engines/hung.py), replace it on whatever node has room. A failed try is logged and tried
        again every engine.replace_retry_s until the server is back, removed, or the pool stops: never abandoned.
        Requests go to the others meanwhile; the pool serves it again (or holds it stale) once it is back."""
        servers = self.servers
        try:
            for attempt in itertools.count(1):
                try:
                    await servers.restart_async(idx)
                    break
                except Exception as e:  # the server stays down; requests keep going to the others
                    if self._retired(idx) or servers.closed:
                        logger.warning("engine server %s: not restarted (%s: %s); it left the pool meanwhile",
                                       servers.address(idx), type(e).__name__, e)  # fmt: skip
                        return
                    self.failed_tries += 1
                    logger.error("restarting engine server %s failed (try %d; %s: %s); trying again in %g s",
                                 servers.address(idx), attempt, type(e).__name__, e,
                                 servers.cfg.replace_retry_s)  # fmt: skip
                    await asyncio.sleep(servers.cfg.replace_retry_s)
            self.stats.restarts += 1
            logger.warning("engine server %s is back; %d request(s) failed on it and went on on the others",
                           servers.address(idx), self.lost_requests.pop(idx, 0))  # fmt: skip
        finally:
            self._restarts.pop(idx, None)
