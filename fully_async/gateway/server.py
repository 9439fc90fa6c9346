"""The gateway: one aiohttp server per process (the rollouter's), one session per running episode.

A session's base URL is `http://HOST:PORT/s/<session id>/v1` and its key is a random secret; every request must carry
`Authorization: Bearer <key>` (401 otherwise, 404 for a session that is not open). Routes under the base URL:
`POST chat/completions`, `POST completions`, `GET models`; beside it, `POST /s/<id>/reward` takes the agent's answer
(a JSON body `{"answer": ...}`, any other JSON value, or plain text). A session's calls run one at a time, each as one
call of the episode's ChatClient (fully_async/agents/rollout_fn.py), which records the exact tokens, log-probs and
versions.

How a call ends:
- a limit (`max_turns`, the response budget) answers 400 (`code` max_turns_exceeded / context_length_exceeded) and
  marks the session `over`: the episode ends with finish_reason length whatever the agent does next;
- anything else that stops the model call (an engine failure past its retries, a weight change with partial rollout
  off, which restarts the episode) answers 503 and fails the session: the episode stops its agent and raises it;
- a refused request (shapes.RequestError) answers 400 and counts nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import secrets
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from aiohttp import web

from fully_async.agents.rollout_fn import EpisodeOver
from fully_async.gateway import shapes

if TYPE_CHECKING:
    from fully_async.agents.rollout_fn import ChatClient

NO_ANSWER = object()
"""A session's `answer` before the agent posted one."""

_FATAL = (asyncio.CancelledError, KeyboardInterrupt, SystemExit)


class Session:
    """One episode's door to the model: its id and key, its ChatClient, and what happened (calls, time in model
    calls, what a request asked that was ignored, the answer posted, the failure that ended it)."""

    def __init__(self, sid: str, chat: ChatClient, base: str) -> None:
        self.sid, self.chat = sid, chat
        self.key = secrets.token_urlsafe(24)
        self.base_url = f"{base}/s/{sid}/v1"
        self.reward_url = f"{base}/s/{sid}/reward"
        self.lock = asyncio.Lock()
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.over: str | None = None
        self.answer: Any = NO_ANSWER
        self.calls = 0
        self.ignored: Counter[str] = Counter()
        self._model_s = 0.0
        self._since: float | None = None
        self._calling: asyncio.Task | None = None

    def model_seconds(self) -> float:
        """Seconds spent inside model calls so far (the one in progress included)."""
        return self._model_s + (time.monotonic() - self._since if self._since is not None else 0.0)

    def fail(self, exc: BaseException) -> None:
        if not self.failed.done():
            self.failed.set_result(exc)

    def end(self) -> None:
        """No further calls; a call in flight (its agent was stopped) is cancelled, so its engine request ends."""
        self.fail(ConnectionAbortedError("session closed"))
        if self._calling is not None:
            self._calling.cancel()

    async def call(self, fn: Any, *args: Any) -> Any:
        """`await fn(*args)` as this session's next model call; returns its result or an error web.Response."""
        async with self.lock:
            if self.failed.done():
                return _error(410, "this session's episode has stopped", code="session_closed")
            self.calls += 1
            self._since, self._calling = time.monotonic(), asyncio.current_task()
            try:
                return await fn(*args)
            except EpisodeOver as e:
                self.over = str(e)
                code = "max_turns_exceeded" if "max_turns" in str(e) else "context_length_exceeded"
                return _error(400, f"the episode's limit is reached: {e}", code=code)
            except _FATAL:
                raise
            except BaseException as e:  # the episode stops (restart, engine failure): its runner raises e
                self.fail(e)
                return _error(503, f"the episode stopped: {type(e).__name__}", "server_error", code="episode_stopped")
            finally:
                self._model_s += time.monotonic() - self._since
                self._since = self._calling = None


def _error(status: int, message: str, kind: str = "invalid_request_error", **kw: Any) -> web.Response:
    return web.json_response(shapes.error(message, kind, **kw), status=status)


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


class GatewayServer:
    """The HTTP server and its open sessions. `await start()` binds (host, port: 0 = free), `open(chat)` makes a
    session, `close(session)` ends it (later calls get 404), `await stop()` unbinds."""

    def __init__(self, tokenizer: Any, host: str = "127.0.0.1", port: int = 0, model: str = "policy") -> None:
        self.tokenizer, self.host, self.port, self.model = tokenizer, host, port, model
        self.sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self._seq = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> GatewayServer:
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([web.post("/s/{sid}/v1/chat/completions", self._chat),
                        web.post("/s/{sid}/v1/completions", self._complete),
                        web.get("/s/{sid}/v1/models", self._models),
                        web.post("/s/{sid}/reward", self._reward),
                        web.get("/health", self._health)])  # fmt: skip
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, chat: ChatClient) -> Session:
        self._seq += 1
        session = Session(f"{os.getpid()}-{self._seq}-{secrets.token_hex(4)}", chat, self.url)
        self.sessions[session.sid] = session
        return session

    def close(self, session: Session) -> None:
        self.sessions.pop(session.sid, None)
        session.end()

    def _session(self, request: web.Request) -> Session | web.Response:
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return _error(404, "no such session (the episode has ended)", code="session_not_found")
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {session.key}".encode()):
            return _error(401, "this session's API key is required", "authentication_error", code="invalid_api_key")
        return session

    async def _body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise shapes.RequestError(f"the body is not JSON: {e}") from e

    async def _open(self, request: web.Request, parse: Any) -> tuple[Session, Any] | web.Response:
        """A model call's session (checked) and its request parsed by `parse` (the keys it ignores counted), or the
        error response to send instead."""
        session = self._session(request)
        if isinstance(session, web.Response):
            return session
        try:
            req = parse(await self._body(request))
        except shapes.RequestError as e:
            return _error(400, str(e), param=e.param)
        session.ignored.update(req.ignored)
        return session, req

    def _cid(self, session: Session, kind: str) -> str:
        return f"{kind}-{session.sid}-{session.calls}"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        opened = await self._open(request, shapes.chat_request)
        if isinstance(opened, web.Response):
            return opened
        session, req = opened
        message = await session.call(session.chat.chat, req.messages, req.tools, req.max_tokens)
        if isinstance(message, web.Response):
            return message
        out = session.chat.last_output
        ids = list(out.token_ids)
        use = shapes.usage(len(session.chat.transcript.ids) - len(ids), len(ids))
        reason, cid = shapes.finish(message, out.finish_reason), self._cid(session, "chatcmpl")
        if req.stream:
            return await self._stream(request, shapes.chat_chunks(cid, self.model, message, reason,
                                                                   use if req.usage_in_stream else None))  # fmt: skip
        lps = shapes.token_logprobs(self.tokenizer, ids, list(out.logprobs)) if req.logprobs else None
        return web.json_response(shapes.chat_response(cid, self.model, message, reason, use, lps))

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        opened = await self._open(request, shapes.completion_request)
        if isinstance(opened, web.Response):
            return opened
        session, req = opened
        ids = req.prompt if isinstance(req.prompt, list) else list(self.tokenizer.encode(req.prompt))
        out = await session.call(session.chat.complete, ids, req.max_tokens)
        if isinstance(out, web.Response):
            return out
        new = list(out.token_ids)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        reason = "length" if out.finish_reason == "length" else "stop"
        use = shapes.usage(len(session.chat.transcript.ids) - len(new), len(new))
        lps = shapes.completion_logprobs(self.tokenizer, new, list(out.logprobs)) if req.logprobs else None
        body = shapes.completion_response(self._cid(session, "cmpl"), self.model, text, reason, use, lps)
        return await self._stream(request, [body]) if req.stream else web.json_response(body)

    async def _stream(self, request: web.Request, chunks: list[dict]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(shapes.sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        session = self._session(request)
        return session if isinstance(session, web.Response) else web.json_response(shapes.models(self.model))

    async def _reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        if isinstance(session, web.Response):
            return session
        raw = await request.text()
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        session.answer = value["answer"] if isinstance(value, dict) and "answer" in value else value
        return web.json_response({"ok": True})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "sessions": len(self.sessions)})
