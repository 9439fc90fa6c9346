"""What happens to an engine server that does not answer a pool-wide control call, is on a lost node, or died under
it (engines/control.py's fan-out, module docstring there): set aside, marked down and handed to the pool's `on_dead`
(restarted or replaced, then brought current), one line each; the call goes on with the others."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from fully_async.aio import bounded
from fully_async.engines.errors import EngineError

logger = logging.getLogger(__name__)

NODE_TABLE_WAIT_S = 2.0
"""How long a pool-wide call waits for Ray's node table (which servers are on dead nodes) before calling every serving
server anyway: the question must not add a deadline of its own to a sync (it answers in milliseconds)."""
DEATH_GRACE_S = 2.0
"""How long a server whose connection broke under a call (reset, refused, closed) may still look alive before its
failure counts as a live server's: a SIGKILLed process's sockets close before its exit can be seen, and on a loaded
machine that window is long enough for a fan-out to see the broken connection and then a process that still runs."""


class Unanswered(EngineError):
    """A server did not answer a control call (or, under a slow call, a liveness probe) within its bound."""


def set_aside(pool: Any, what: str, indices: list[int], why: str) -> None:
    """Servers `indices` are out of this call and of the pool until they are back: marked down and handed to the
    pool's `on_dead` (restarted or replaced, then brought current). One line each."""
    for i in indices:
        logger.warning("%s: engine server %s %s; set aside (down, to be restarted or replaced), the pool goes on "
                       "without it", what, pool.address(i), why)  # fmt: skip
        pool.server_died(i)


async def set_aside_lost(pool: Any, what: str, deadline_s: float) -> None:
    """Set aside the serving servers whose Ray node is known dead: they are never called."""
    try:
        wait_s = min(NODE_TABLE_WAIT_S, deadline_s)
        lost = await bounded(asyncio.to_thread(pool.on_lost_nodes, pool.serving), wait_s)
    except TimeoutError:
        logger.warning("%s: Ray's node table did not answer within %g s; calling every serving server", what,
                       wait_s)  # fmt: skip
        return
    if lost:
        set_aside(pool, what, lost, "is on a node Ray reports dead")
        await pool.sync_router_async()


async def set_aside_unanswered(pool: Any, what: str, urls: list[str], results: list[Any]) -> list[Any]:
    """Set aside each server that did not answer (Unanswered); their failures are dropped. When no server
    answered and some did not answer in time, the call fails instead (EngineError naming them)."""
    missed = [k for k, r in enumerate(results) if isinstance(r, Unanswered)]
    if not missed:
        return results
    if len(missed) == len(urls):
        raise EngineError(f"{pool.kind.name} {what}: no engine server answered in time: "
                          + "; ".join(f"{urls[k]}: {results[k]}" for k in missed))  # fmt: skip
    index = {pool.address(i): i for i in pool.live}
    out = list(results)
    for k in missed:
        if urls[k] in index:
            set_aside(pool, what, [index[urls[k]]], f"did not answer ({results[k]})")
            out[k] = None
    await pool.sync_router_async()
    return out


async def drop_dead(pool: Any, what: str, urls: list[str], results: list[Any], deadline_s: float) -> list[Any]:
    """Each failed server whose process (or engine host, or node) is gone is marked down and handed to the pool's
    `on_dead`; its failure is dropped. A live server that failed keeps its failure. A server whose liveness is
    not known within `deadline_s` (its host's node does not answer) counts as gone."""
    index = {pool.address(i): i for i in pool.live}
    out = list(results)
    for k, (url, r) in enumerate(zip(urls, results)):
        if not isinstance(r, Exception) or url not in index:
            continue
        broken = isinstance(r.__cause__, aiohttp.ClientConnectionError)
        if not await gone(pool, index[url], deadline_s, min(DEATH_GRACE_S, deadline_s) if broken else 0.0):
            continue
        logger.warning("%s: engine server %s is gone (%s); the pool goes on without it", what, url, r)
        pool.server_died(index[url])
        out[k] = None
    if any(r is None and isinstance(x, Exception) for r, x in zip(out, results)):
        await pool.sync_router_async()
    return out


async def gone(pool: Any, index: int, deadline_s: float, grace_s: float) -> bool:
    """Whether server `index`'s process (or engine host, or node) is gone, looking again for up to `grace_s` while it
    still seems alive. A liveness not known within `deadline_s` counts as gone."""
    end = time.monotonic() + grace_s
    while True:
        try:
            if not await bounded(asyncio.to_thread(pool.is_alive, index), deadline_s):
                return True
        except TimeoutError:
            return True
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(0.05)
