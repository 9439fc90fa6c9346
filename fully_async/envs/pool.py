"""A pool of environment servers for one process's episodes: N launched processes of `rollout.multi_turn.env.app`
(or servers already running, `env.urls`), health-checked, a dead launched one replaced.

Reuses the engine servers' process handling (fully_async/engines/process.py: a free port on 127.0.0.1, the watchdog
that takes a server down with its launcher, /health, stop by process group). `acquire()` hands out the least-busy
live server, so a fresh environment after an infrastructure failure lands on another server when one is up;
`suspect(url)` (an episode's call failed there) makes the next health check look at once. Counters: `replacements`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fully_async.aio import bounded
from fully_async.config import EnvConfig
from fully_async.engines.process import ServerProcess
from fully_async.envs import MAX_CONCURRENT_ENV
from fully_async.envs.failures import InfraError

log = logging.getLogger(__name__)

ACQUIRE_WAIT_S = 0.2
"""Poll interval of acquire() while no server is up (one is being replaced)."""


class EnvServerPool:
    def __init__(self, cfg: EnvConfig, log_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="fully_async-envs-"))
        if cfg.urls:
            self.servers = [ServerProcess.external(u) for u in cfg.urls]
        else:
            self.servers = [
                ServerProcess(
                    name=f"env server {i}",
                    command=self._command,
                    env={MAX_CONCURRENT_ENV: str(cfg.max_concurrent_envs)},
                    log_path=self.log_dir / f"env-{i}.log",
                )
                for i in range(cfg.servers)
            ]
        self.up: dict[str, bool] = {}
        self.busy: dict[str, int] = {}
        self.replacements = 0
        self._suspect = asyncio.Event()
        self._monitor: asyncio.Task | None = None
        self._stopped = False
        self._launching = threading.Lock()
        """Held while a server is launched and by stop(): a replacement that runs on in its thread after stop()
        cancelled the health checks must not start a server nobody stops."""

    def _command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "fully_async.envs.serve", self.cfg.app, "--port", str(port)]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    async def start(self) -> None:
        """Launch every server (in parallel) and wait until each answers /health; then start the health checks."""
        await asyncio.gather(*(asyncio.to_thread(self._launch, s) for s in self.servers))
        self._monitor = asyncio.get_running_loop().create_task(self._watch())

    def _launch(self, server: ServerProcess) -> None:
        with self._launching:
            if self._stopped:
                return
            server.launch()
        server.wait_healthy(self.cfg.startup_timeout_s)
        self.up[server.url] = True
        self.busy.setdefault(server.url, 0)

    async def acquire(self) -> str:
        """The URL of the least-busy live server (counted busy until `release`); waits while none is up, at most
        call_timeout_s, then raises InfraError('refused')."""
        deadline = time.monotonic() + self.cfg.call_timeout_s
        while True:
            live = [s.url for s in self.servers if self.up.get(s.url)]
            if live:
                url = min(live, key=lambda u: self.busy.get(u, 0))
                self.busy[url] = self.busy.get(url, 0) + 1
                return url
            if time.monotonic() > deadline:
                raise InfraError("refused", f"no environment server up for {self.cfg.call_timeout_s:.0f} s")
            await asyncio.sleep(ACQUIRE_WAIT_S)

    def release(self, url: str) -> None:
        self.busy[url] = max(0, self.busy.get(url, 0) - 1)

    def suspect(self, url: str) -> None:
        """An episode's call to `url` failed for infrastructure reasons: route nothing new there until the health
        check has looked (at once)."""
        if url in self.up:
            self.up[url] = False
        self._suspect.set()

    async def _watch(self) -> None:
        # bounded, not asyncio.wait_for: on Python 3.11 that swallows stop()'s cancel when it meets a wait that has
        # just finished (a suspect() right before stop()), and the checks went on for ever (fully_async/aio.py).
        while not self._stopped:
            with contextlib.suppress(TimeoutError):  # the interval passed with no suspect: check anyway
                await bounded(self._suspect.wait(), self.cfg.health_interval_s)
            if self._stopped:
                return
            self._suspect.clear()
            for server in self.servers:
                try:
                    await self.check(server)
                except Exception as e:  # a replacement that fails must not stop the checks of the others
                    log.error("replacing %s failed: %s: %s", server.name, type(e).__name__, e)

    async def check(self, server: ServerProcess) -> None:
        """Mark `server` up or down by its /health; replace a launched one whose process died or stopped answering."""
        healthy = await asyncio.to_thread(server.healthy)
        self.up[server.url] = healthy
        if healthy or not server.launched:
            return
        log.warning("%s at %s is down (process alive: %s); replacing it", server.name, server.url, server.is_alive())
        old = server.url
        await asyncio.to_thread(server.stop, 5.0)
        self.up.pop(old, None)
        self.busy.pop(old, None)
        await asyncio.to_thread(self._launch, server)
        self.replacements += 1
        log.info("%s replaced, now at %s", server.name, server.url)

    def stats(self) -> dict[str, Any]:
        return {"servers": len(self.servers), "up": sum(self.up.values()), "replacements": self.replacements}

    async def stop(self) -> None:
        with self._launching:
            self._stopped = True
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(s.stop, 5.0) for s in self.servers))
