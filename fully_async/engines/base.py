"""The engine boundary: what the rollout path needs from a pool of inference servers, whatever their kind.

An `EngineServers` owns N server processes (or attaches to servers started elsewhere) and drives all of them at once
through the control plane: pause, resume, reload weights, set the weight version, reset the prefix cache. An adapter
(vLLM here, SGLang later) supplies only what differs between engine kinds: the command line and environment, the
endpoints, and the shape of a token-level generate request and its response. `EngineClient` (client.py) is generic.

Version bookkeeping: `state.version` is the number of completed weight syncs whose weights the servers hold; the
control plane sets it (and tells the servers, which label the tokens they produce with it where the engine supports
that). `state` also carries the pause flag and the event an aborted request waits on before it continues.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp

from fully_async.config import EngineConfig
from fully_async.engines.errors import EngineError
from fully_async.engines.process import ServerProcess

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "keep"]


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request; the same values must be used by the trainer for its log-probs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_rollout(cls, rollout: Any, **overrides: Any) -> Sampling:
        """From a RolloutConfig (temperature, top_p, top_k)."""
        values = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)
        return cls(**{**values, **overrides})


@dataclass
class GenerationResult:
    """One finished sample. token_ids, logprobs and versions have equal length (at most the requested budget); each
    is a list, or the engine's numpy array when the sample came from one segment whose tokens were all kept."""

    token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each chosen token under the distribution it was sampled from."""
    versions: list[int]
    """Weight version that produced each token."""
    finish_reason: str
    """'stop' (an end token or stop id, included in token_ids) or 'length' (budget spent)."""
    start_version: int = 0
    """Weight version when the request was first sent."""
    num_aborts: int = 0
    """Times a pause aborted the request and it was continued from its tokens so far."""
    num_retries: int = 0
    """Times the request was re-sent after a server failure."""
    servers: list[str] = field(default_factory=list)
    """URL of the server of each segment, in order."""


@dataclass
class Segment:
    """What one HTTP generate call returned (parsed by the adapter). The three sequences are lists, or numpy arrays
    (int32 ids and versions, float32 log-probs) from an engine that has them without parsing (engine=sim); the
    client passes a sample's only segment through as it is, so an array is never converted element by element."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int | None] | None = None
    """Per-token versions reported by the engine, None where it reported none (the client then uses its own)."""


@dataclass(frozen=True)
class HttpCall:
    """One control-plane HTTP call, built by the adapter and run by the generic machinery on every server."""

    method: str
    path: str
    params: dict[str, str] | None = None
    json: Any = None
    check: Any = None
    """Optional callable(response_json) -> error string or None, for endpoints that report failure in a 200."""


class EngineState:
    """Version and pause state shared by the control plane and the clients in this process."""

    def __init__(self) -> None:
        self.version = 0
        self.paused = False
        self._resumed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def resumed(self) -> asyncio.Event:
        """Set while not paused. Re-created per event loop: an asyncio.Event is bound to the loop that first waits on
        it, and lifecycle code (or a test) may drive this state from a different loop later."""
        loop = asyncio.get_running_loop()
        if self._resumed is None or self._loop is not loop:
            self._resumed, self._loop = asyncio.Event(), loop
            if not self.paused:
                self._resumed.set()
        return self._resumed

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if paused:
            self.resumed.clear()
        else:
            self.resumed.set()


class EngineServers(abc.ABC):
    """A pool of engine servers of one kind: lifecycle (start, stop, restart one) and the control plane for all."""

    kind: str = "?"
    in_process = False
    """True for emulated engines that answer generate requests through `send_direct` instead of HTTP."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_path: str | Path,
        run_dir: str | Path,
        addresses: list[str] | None = None,
        hosts: list[Any] | None = None,
        device: str | None = None,
    ):
        """addresses: attach to servers already running there (nothing is launched, restart is impossible);
        hosts: one `EngineHost` actor per server (engines/host.py), placed by the job: each server runs on its
        host's node; neither: the servers are child processes of this one. device: 'cuda' or 'cpu' (the job's
        fully_async.host.device; None = this machine's)."""
        from fully_async.host import device as run_device

        self.cfg = cfg
        self.model_path = Path(model_path)
        self.run_dir = Path(run_dir)
        self.device = device or run_device("auto")
        self.state = EngineState()
        self.weights_dir: Path | None = None
        """Directory of the weights loaded last; a restarted server reloads it."""
        self.hosts = hosts
        if addresses is not None:
            self.procs = [ServerProcess.external(url) for url in addresses]
        else:
            count = len(hosts) if hosts is not None else cfg.num_servers
            self.procs = [self._new_process(i) for i in range(count)]

    # ---- adapter hooks -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def command(self, index: int, port: int, host: str | None = None) -> list[str]:
        """Command line of server `index` listening on `host` (None: the local bind address) and `port`."""

    @abc.abstractmethod
    def environment(self, index: int) -> dict[str, str]:
        """Environment variables added for server `index`."""

    health_path = "/health"

    @abc.abstractmethod
    def generate_request(self, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> tuple[str, dict]:
        """(path, JSON body) of a token-level generate call returning log-probs of the chosen tokens."""

    @abc.abstractmethod
    def parse_generate(self, body: Any) -> Segment:
        """Parse a generate response; raise ValueError when it is malformed."""

    async def send_direct(self, idx: int, prompt_ids: list[int], max_tokens: int, sampling: Sampling) -> Segment:
        """Generate on server `idx` without HTTP (only where `in_process`)."""
        raise NotImplementedError(f"{self.kind} servers are reached over HTTP")

    @abc.abstractmethod
    def pause_call(self, mode: PauseMode) -> HttpCall: ...

    @abc.abstractmethod
    def resume_call(self) -> HttpCall: ...

    @abc.abstractmethod
    def is_paused_call(self) -> tuple[HttpCall, Any]:
        """The call and a function(response_json) -> bool."""

    @abc.abstractmethod
    def reload_weights_call(self, weights_dir: Path) -> HttpCall: ...

    @abc.abstractmethod
    def set_version_call(self, version: int) -> HttpCall: ...

    @abc.abstractmethod
    def reset_prefix_cache_call(self) -> HttpCall: ...

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    @property
    def local_bind(self) -> str:
        """Bind address of servers started as children of this process ("auto" = loopback)."""
        return "127.0.0.1" if self.cfg.host == "auto" else self.cfg.host

    def _new_process(self, index: int, port: int | None = None) -> ServerProcess:
        name, log_path = f"{self.kind}-{index}", self.run_dir / "engines" / f"{self.kind}-{index}.log"
        if self.hosts is not None:
            from fully_async.engines.host import RemoteServer

            return RemoteServer(
                name, self.hosts[index], lambda port, host: self.command(index, port, host),
                self.environment(index), log_path, self.health_path,
            )  # fmt: skip
        return ServerProcess(
            name=name,
            command=lambda port: self.command(index, port, self.local_bind),
            env=self.environment(index),
            log_path=log_path,
            host=self.local_bind,
            health_path=self.health_path,
            port=port,
        )

    def log_tail(self, index: int, lines: int = 40) -> str:
        """The last lines of server `index`'s log, read on its node."""
        return self.procs[index].tail(lines)

    @property
    def addresses(self) -> list[str]:
        return [p.url for p in self.procs]

    def address(self, index: int) -> str:
        """URL of server `index`; O(1), for per-request paths (`addresses` builds the whole list)."""
        return self.procs[index].url

    def start(self) -> None:
        """Launch every server and block until all are healthy (EngineError with the log tail otherwise)."""
        try:
            for p in self.procs:
                p.launch()
            for p in self.procs:
                p.wait_healthy(self.cfg.startup_timeout_s)
            self._run_sync(self._after_start(range(len(self.procs))))
        except BaseException:
            self.stop()  # a half-started pool would hold memory and cores until interpreter exit
            raise

    def stop(self) -> None:
        """Stop every launched server (and its children); safe to call twice."""
        for p in self.procs:
            p.stop()

    def is_alive(self, index: int) -> bool:
        return self.procs[index].is_alive()

    def log_path(self, index: int) -> Path | None:
        return self.procs[index].log_path

    def restart(self, index: int) -> None:
        """Restart server `index` on its old address with the latest weights and version. Blocks until healthy."""
        proc = self.procs[index]
        proc.stop()
        proc.launch()
        proc.wait_healthy(self.cfg.startup_timeout_s)
        self._run_sync(self._after_start([index]))

    async def _after_start(self, indices) -> None:
        urls = [self.procs[i].url for i in indices]
        if self.weights_dir is not None:
            await self._call_all("reload weights", self.reload_weights_call(self.weights_dir), urls)
        await self._call_all("set version", self.set_version_call(self.state.version), urls)

    @staticmethod
    def _run_sync(coro) -> None:
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

    # ---- control plane ---------------------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        """abort: in-flight requests return their tokens so far (the client continues them after resume);
        keep: they freeze and finish after resume."""
        self.state.set_paused(True)
        await self._call_all("pause", self.pause_call(mode))

    async def resume(self) -> None:
        await self._call_all("resume", self.resume_call())
        self.state.set_paused(False)

    async def load_weights(self, weights_dir: str | Path, version: int) -> None:
        """Reload weights from a directory of safetensors (checkpoint names) on every server, then set the version.
        Call between pause and resume."""
        weights_dir = Path(weights_dir).resolve()
        await self._call_all("reload weights", self.reload_weights_call(weights_dir))
        self.weights_dir = weights_dir
        try:
            # KV blocks cached under the old weights must not serve continued prompts.
            await self.reset_prefix_cache()
        except EngineError as e:  # with pause(keep) frozen requests hold blocks; the cache then drains on its own
            logger.warning("prefix cache not reset after a weight reload: %s", e)
        await self.set_version(version)

    async def set_version(self, version: int) -> None:
        await self._call_all("set version", self.set_version_call(version))
        self.state.version = version

    async def reset_prefix_cache(self) -> None:
        await self._call_all("reset prefix cache", self.reset_prefix_cache_call())

    async def is_paused(self, url: str) -> bool:
        call, read = self.is_paused_call()
        (body,) = await self._call_all("is paused", call, [url])
        return bool(read(body))

    async def _call_all(self, what: str, call: HttpCall, urls: list[str] | None = None) -> list[Any]:
        """Run `call` on every server at once; EngineError naming each failed server (and its log) otherwise."""
        urls = self.addresses if urls is None else urls
        from fully_async.engines.auth import auth_headers

        timeout = aiohttp.ClientTimeout(total=self.cfg.control_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session:
            results = await asyncio.gather(
                *(self._call_one(session, url, call) for url in urls), return_exceptions=True
            )
        failed = [f"{url}: {r} (log: {self.log_for(url)})" for url, r in zip(urls, results) if isinstance(r, Exception)]
        if failed:
            raise EngineError(
                f"{self.kind} {what} failed on {len(failed)} of {len(urls)} servers: " + "; ".join(failed)
            )
        return results

    @staticmethod
    async def _call_one(session: aiohttp.ClientSession, url: str, call: HttpCall) -> Any:
        try:
            async with session.request(call.method, url + call.path, params=call.params, json=call.json) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise EngineError(f"HTTP {resp.status}: {text[:300]}")
        except asyncio.TimeoutError as e:
            raise EngineError(f"no answer to {call.method} {call.path} within the control timeout") from e
        except aiohttp.ClientError as e:
            raise EngineError(f"{call.method} {call.path}: {type(e).__name__}: {e}") from e
        try:
            body = json.loads(text) if text.strip() else None
        except ValueError:
            body = text  # a plain-text answer (SGLang's /flush_cache); `check` may read it
        if call.check is not None and (err := call.check(body)):
            raise EngineError(err)
        return body

    def log_for(self, url: str) -> str:
        for p in self.procs:
            if p.url == url:
                return str(p.log_path) if p.log_path else "external server, no log here"
        return "unknown server"
