"""Running the user's agent for one episode: a command (a process of its own) or a Python callable, supervised.

A command runs under fully_async.engines.watchdog in a new session (process group): stopping it SIGKILLs the whole
group, and when the rollouter dies however it died (SIGKILL included) the watchdog sees its lifeline close and takes
the agent and everything it spawned down. A callable runs as a task (async) or in a thread (sync: a thread cannot be
killed, so one that hangs is abandoned at the timeout; its later calls find the session closed).

`supervise` waits for the agent to finish while counting only the agent's own time against the timeout (time inside
model calls, which a weight sync may pause, does not count) and stops it when its session fails (a restart, an
engine failure). A crash (an exception, a nonzero exit, a signal) or a timeout is an InfraError (envs/failures.py):
the episode restarts, then its group is re-issued; it never becomes a reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fully_async.engines import watchdog
from fully_async.envs.failures import InfraError

if TYPE_CHECKING:
    from fully_async.gateway.server import Session

TAIL_BYTES = 16384
"""What is kept of an agent's stdout and stderr (the answer is stdout's last line; stderr names a crash)."""


@dataclass
class Exit:
    """How an agent ended: its exit code (0 = success), its answer (a callable's return value, or stdout's last
    non-empty line), and the end of its stderr or its exception (for a crash's message)."""

    code: int
    answer: Any = None
    detail: str = ""


async def _tail(stream: asyncio.StreamReader) -> bytes:
    kept: deque[bytes] = deque()
    size = 0
    while chunk := await stream.read(65536):
        kept.append(chunk)
        size += len(chunk)
        while size - len(kept[0]) >= TAIL_BYTES:
            size -= len(kept.popleft())
    return b"".join(kept)[-TAIL_BYTES:]


class CommandAgent:
    """The agent as a process: `argv` with `env`, in `cwd`, `stdin` written to it and closed."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None, stdin: bytes) -> None:
        self.argv, self.env, self.cwd, self.stdin = argv, env, cwd, stdin
        self.proc: asyncio.subprocess.Process | None = None
        self._lifeline: int | None = None
        self._reads: list[asyncio.Task] = []

    async def start(self) -> None:
        lifeline_r, self._lifeline = os.pipe()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *watchdog.command(lifeline_r, self.argv),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=(lifeline_r,), start_new_session=True, env=self.env, cwd=self.cwd,
            )  # fmt: skip
        except OSError as e:
            self._close_lifeline()
            raise InfraError("agent_crash", f"the agent could not start: {e}") from e
        finally:
            os.close(lifeline_r)
        self._reads = [asyncio.ensure_future(_tail(self.proc.stdout)), asyncio.ensure_future(_tail(self.proc.stderr))]
        with contextlib.suppress(ConnectionError):  # an agent that exits without reading its stdin
            self.proc.stdin.write(self.stdin)
            await self.proc.stdin.drain()
        self.proc.stdin.close()

    async def wait(self) -> Exit:
        code = await self.proc.wait()
        out, err = await asyncio.gather(*self._reads)
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        return Exit(code, lines[-1].strip() if lines else None, err.decode(errors="replace")[-2000:])

    async def stop(self) -> None:
        """SIGKILL the agent's process group (the watchdog, the agent, its children) and reap it."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        for task in self._reads:
            task.cancel()
        self._close_lifeline()

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None


class CallableAgent:
    """The agent as `fn(base_url, api_key, task)`: awaited as a task (async) or run in a thread (sync)."""

    def __init__(self, fn: Any, base_url: str, key: str, task: dict[str, Any]) -> None:
        self.fn, self.args = fn, (base_url, key, task)
        self._task: asyncio.Future | None = None

    async def start(self) -> None:
        if inspect.iscoroutinefunction(self.fn):
            self._task = asyncio.ensure_future(self.fn(*self.args))
        else:
            self._task = asyncio.ensure_future(asyncio.to_thread(self.fn, *self.args))

    async def wait(self) -> Exit:
        try:
            return Exit(0, await self._task)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the agent's own crash: an infrastructure failure, named in the log
            return Exit(1, None, f"{type(e).__name__}: {e}")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a thread goes on until it returns; its calls then find the session closed
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


async def supervise(agent: CommandAgent | CallableAgent, session: Session, timeout_s: float) -> Exit:
    """Start `agent`, wait for its end and return it; stop it (always) when it ends, when its session fails (raises
    that failure) or when its own time passes `timeout_s` (InfraError 'agent_timeout')."""
    await agent.start()
    waiter = asyncio.ensure_future(agent.wait())
    start = time.monotonic()
    try:
        while True:
            left = timeout_s - (time.monotonic() - start - session.model_seconds())
            if left <= 0:
                raise InfraError("agent_timeout", f"the agent ran past {timeout_s:g} s of its own time "
                                                  "(rollout.multi_turn.gateway.timeout_s)")  # fmt: skip
            await asyncio.wait({waiter, session.failed}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if session.failed.done():
                raise session.failed.result()
            if waiter.done():
                return waiter.result()
    finally:
        await agent.stop()
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter


def crash(ended: Exit) -> InfraError:
    """The infrastructure failure a nonzero exit stands for (a watchdog passes a signal on as 256 - signal)."""
    what = f"exited with code {ended.code}"
    if ended.code < 0 or ended.code > 128:
        what += f" (killed by signal {-ended.code if ended.code < 0 else 256 - ended.code}?)"
    return InfraError("agent_crash", f"the agent {what}: {ended.detail.strip()[-500:] or '(no stderr)'}")


def read_answer(session: Session, answer_file: Path, ended: Exit | None, no_answer: object) -> Any:
    """The agent's answer: what it posted to /reward, else the JSON file it wrote (`{"answer": ...}` or any JSON
    value), else its callable's return value or stdout's last line; None when it gave none (the reward then scores
    the last assistant content)."""
    if session.answer is not no_answer:
        return session.answer
    if answer_file.exists():
        try:
            value = json.loads(answer_file.read_text())
        except (OSError, ValueError):
            value = answer_file.read_text(errors="replace").strip()
        return value["answer"] if isinstance(value, dict) and "answer" in value else value
    return ended.answer if ended is not None else None
