"""The run's token for engine servers that leave loopback.

On loopback nothing changes: servers bind 127.0.0.1 and take no token. A server that must be reached from other
nodes still binds 127.0.0.1 on its node; its engine host puts an `AuthProxy` on the node's address in front of it,
which forwards a request only when it carries `Authorization: Bearer <token>`. The proxy guards every path the same
way (generate, pause, reload, collective_rpc, ...): the engines' own API-key options guard only their OpenAI routes.

The token is generated once per run by the job (`ensure_token`), lives in the environment variable TOKEN_ENV of the
driver and of the actors it starts (Ray runtime_env), and is never printed, logged or put on a command line.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import threading

TOKEN_ENV = "FULLY_ASYNC_ENGINE_TOKEN"

log = logging.getLogger(__name__)


def ensure_token() -> str:
    """The run's token: TOKEN_ENV when the user set it, else a new random one (set in this process's environment)."""
    token = os.environ.get(TOKEN_ENV)
    if not token:
        token = secrets.token_urlsafe(32)
        os.environ[TOKEN_ENV] = token
    return token


def auth_headers() -> dict[str, str]:
    """Headers every request to an engine server carries (none when the run has no token)."""
    token = os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


class AuthProxy:
    """HTTP reverse proxy on (host, port) to `target` (a loopback URL), requiring the token. Runs its own event loop
    in a daemon thread; `close()` stops it."""

    def __init__(self, host: str, port: int, target: str, token: str):
        if not token:
            raise ValueError("an AuthProxy needs a non-empty token")
        self.host, self.port, self.target = host, port, target.rstrip("/")
        self._expected = f"Bearer {token}".encode()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.rejected = 0
        self._thread = threading.Thread(target=self._run, name="engine-auth-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:  # reported to the constructor, which raises it
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        # Long generations: no total timeout on the forwarded call (the client's own request timeout governs).
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

    async def _forward(self, request):
        from aiohttp import web

        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, self._expected):
            self.rejected += 1
            if self.rejected in (1, 10, 100, 1000):  # counted, not printed per request
                log.warning(
                    "engine auth proxy %s: %d requests without the run's token refused", self.url, self.rejected
                )
            return web.json_response({"error": "missing or wrong token"}, status=401)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with self._session.request(
            request.method, self.target + request.rel_url.path_qs, data=body or None, headers=headers
        ) as resp:
            payload = await resp.read()
            return web.Response(body=payload, status=resp.status, content_type=resp.content_type)

    def close(self) -> None:
        async def stop() -> None:
            await self._session.close()
            await self._runner.cleanup()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
