"""An sglang-router process in front of a pool of SGLang servers (engine.router=sglang; sglang-router 0.3.2).

The router answers `/generate` by forwarding it to one of its workers, chosen by its policy (cache-aware by default:
the worker whose radix tree shares the longest prefix with the prompt, unless the load is unbalanced). It does not
forward the control endpoints (`/pause_generation`, `/continue_generation`, `/update_weights_from_disk`,
`/update_weight_version`, `/model_info`: 404), so the pool keeps calling each server directly for those.

The pool owns the router's process (started after the servers, stopped with them: `ServerProcess` with its watchdog,
so it never outlives this process) and keeps its worker list equal to the servers that may serve (`sync`): in the
pool, not down, not stale. Worker management in 0.3.2 (verified against the binary; the older `/add_worker`,
`/remove_worker`, `/list_workers` answer 404): `GET /workers` lists {id, url, is_healthy, load}; `POST /workers
{"url"}` answers 202 and registers the worker in the background (health check and model info first, ~1-2 s);
`DELETE /workers/{id}` answers 202 and removes it in the background. `sync` waits until the list matches.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from fully_async.engines.auth import auth_headers
from fully_async.engines.errors import EngineError
from fully_async.engines.process import ServerProcess, free_port

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _connect_host(bind: str) -> str:
    """Where this process reaches a router bound to `bind` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind


class SGLangRouter:
    """One sglang-router process. `start(urls)` launches it over those workers and waits until all are registered
    and healthy; `sync(urls)` makes its worker list equal `urls`; `stop()` ends it (and its process group)."""

    def __init__(self, python: str, cfg: Any, log_path: Path):
        self.cfg = cfg
        self.python = python
        bind = cfg.router_host
        self.proc = ServerProcess(
            name="sglang-router",
            command=lambda port: self.command(port),
            env={"PYTHONUNBUFFERED": "1", "NO_COLOR": "1"},
            log_path=log_path,
            host=_connect_host(bind),
            health_path="/health",
        )
        self._lock = threading.Lock()  # syncs from several threads (restarts, removals) must not interleave their diffs
        self._initial: list[str] = []

    def command(self, port: int) -> list[str]:
        cfg = self.cfg
        cmd = [
            self.python, "-m", "sglang_router.launch_router",
            "--host", cfg.router_host, "--port", str(port),
            "--policy", cfg.router_policy,
            # Our client's timeout governs a request; the router must not cut a long generation short before it.
            "--request-timeout-secs", str(int(cfg.request_timeout_s) + 60),
            # INFO logs two lines per request: at thousands of requests a second that is the router's main cost.
            "--log-level", "warn",
        ]  # fmt: skip
        if self._initial:
            cmd += ["--worker-urls", *self._initial]
        return cmd

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def pid(self) -> int | None:
        """Process id of the router's watchdog, the leader of its process group (None when not running)."""
        return self.proc.popen.pid if self.proc.popen is not None else None

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def start(self, urls: list[str], timeout_s: float) -> None:
        """Launch the router over `urls` and wait until it is healthy and every worker is registered and healthy."""
        _check_reachable(urls)
        self._initial = list(urls)
        self.proc.launch()
        try:
            self.proc.wait_healthy(timeout_s)
            # It registers the --worker-urls in the background: wait for them (a sync now would post them twice).
            with self._lock:
                self._wait(urls, timeout_s)
        except BaseException:
            self.stop()
            raise

    def restart(self, urls: list[str], timeout_s: float) -> None:
        """A router that died is started again (a new port) over the current workers."""
        self.stop()
        self.proc.port = free_port(self.proc.host)
        self.start(urls, timeout_s)

    def stop(self) -> None:
        """End the router's process group; safe to call twice."""
        self.proc.stop(grace_s=5.0)

    # ---- worker list -----------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, timeout_s: float = 10.0) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            raise EngineError(f"router {method} {path}: HTTP {e.code}: {e.read().decode()[:300]}") from e
        except (urllib.error.URLError, OSError) as e:
            raise EngineError(f"router {method} {path}: {type(e).__name__}: {e}") from e
        return json.loads(text) if text.strip() else None

    def workers(self) -> list[dict[str, Any]]:
        """The router's workers: [{id, url, is_healthy, load, ...}]."""
        return (self._request("GET", "/workers") or {}).get("workers", [])

    def sync(self, urls: list[str], timeout_s: float = 60.0) -> None:
        """Make the router's workers exactly `urls`: remove the others, add the missing, then wait (up to timeout_s)
        until the list matches and every worker is healthy. EngineError otherwise."""
        want = list(dict.fromkeys(u.rstrip("/") for u in urls))
        _check_reachable(want)
        with self._lock:
            have = {w["url"].rstrip("/"): w for w in self.workers()}
            for url, w in have.items():
                if url not in want:
                    self._request("DELETE", f"/workers/{w['id']}")
                    logger.info("router: worker %s removed", url)
            for url in want:
                if url not in have:
                    self._request("POST", "/workers", {"url": url})
                    logger.info("router: worker %s added", url)
            self._wait(want, timeout_s)

    def _wait(self, urls: list[str], timeout_s: float) -> None:
        want = {u.rstrip("/") for u in urls}
        deadline = time.monotonic() + timeout_s
        while True:
            now = {w["url"].rstrip("/"): w for w in self.workers()}
            if set(now) == want and all(w.get("is_healthy") for w in now.values()):
                return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"router workers {sorted(now)} (healthy: {[u for u, w in now.items() if w.get('is_healthy')]}) "
                    f"did not become {sorted(want)} within {timeout_s:g} s; log {self.proc.log_path}"
                )
            time.sleep(0.1)


def _check_reachable(urls: list[str]) -> None:
    """A server on another node sits behind the engine auth proxy (engines/auth.py), which wants the run's token: the
    router's health checks and forwarded requests carry none, so it can front only servers on this node's loopback."""
    if not auth_headers():
        return
    for url in urls:
        if (urllib.parse.urlsplit(url).hostname or "") not in LOOPBACK:
            raise EngineError(
                f"engine.router=sglang: server {url} is on another node, behind the engine auth proxy, which the "
                "router cannot pass (use engine.router=none for multi-node pools)"
            )
