"""The one JSON POST of the remote scorers (the reward model's client and the distillation teacher's,
fully_async/reward/judge.py `post_json`) against a real aiohttp server on 127.0.0.1: an answer, an HTTP error with its
status and Retry-After (what the retry rule reads), an answer that is not JSON, and a server that is not there."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from fully_async.engines.process import free_port
from fully_async.reward.judge import RemoteError, post_json, retryable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def server():
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"got": await request.json()})

    async def busy(request: web.Request) -> web.Response:
        return web.Response(status=503, text="overloaded", headers={"Retry-After": "7"})

    async def refused(request: web.Request) -> web.Response:
        return web.Response(status=400, text="bad request")

    async def garbled(request: web.Request) -> web.Response:
        return web.Response(status=200, text="<html>not json</html>")

    app = web.Application()
    for path, handler in (("/ok", ok), ("/busy", busy), ("/refused", refused), ("/garbled", garbled)):
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_answers_errors_and_a_missing_server_each_come_back_as_what_they_are(server):
    lost: list[str] = []

    async def unreachable() -> None:
        lost.append("called")

    async with aiohttp.ClientSession() as session:
        assert await post_json(session, server + "/ok", {"ids": [1, 2]}, "teacher") == {"got": {"ids": [1, 2]}}
        with pytest.raises(RemoteError, match="teacher answered HTTP 503: overloaded") as busy:
            await post_json(session, server + "/busy", {}, "teacher")
        assert busy.value.status == 503 and busy.value.retry_after == 7.0 and retryable(busy.value)
        with pytest.raises(RemoteError, match="reward model answered HTTP 400") as refused:
            await post_json(session, server + "/refused", {}, "reward model")
        assert refused.value.status == 400 and not retryable(refused.value)
        with pytest.raises(RemoteError, match="teacher sent a malformed response"):
            await post_json(session, server + "/garbled", {}, "teacher")
        assert lost == []
        gone = f"http://127.0.0.1:{free_port('127.0.0.1')}/v1/completions"
        with pytest.raises(RemoteError, match=f"teacher unreachable at {gone}: ClientConnectorError") as missing:
            await post_json(session, gone, {}, "teacher", on_unreachable=unreachable)
        assert missing.value.status is None and retryable(missing.value) and lost == ["called"]
