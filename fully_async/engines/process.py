"""One engine server process: launch on a free port, wait for health, stop with its whole process group.

Hygiene contract: a launched server never outlives the process that launched it, even when that process is
SIGKILLed. The server runs under `fully_async.engines.watchdog` in its own session: stop() signals the group; the
watchdog holds the read end of a lifeline pipe whose write end only this process holds and, when it closes, takes
the server and every child it spawned (vLLM's engine core) down. PR_SET_PDEATHSIG is set too where it works (launched from the main thread), and an atexit hook stops whatever
is still running when the interpreter exits.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fully_async.engines.errors import EngineError

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for proc in list(_LIVE):
        proc.stop()


atexit.register(_stop_all_at_exit)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the server binds it shortly after; a clash shows in its log)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def tail(path: Path | None, lines: int = 40) -> str:
    """The last lines of a log file, or a note why there are none."""
    if path is None:
        return "(external server: no log here)"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


class ServerProcess:
    """A server process and its URL. `external(url)` wraps a server started elsewhere (never launched or stopped)."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]] | None,
        env: dict[str, str],
        log_path: Path | None,
        host: str = "127.0.0.1",
        health_path: str = "/health",
        port: int | None = None,
    ):
        self.name = name
        self.command = command
        self.env = env
        self.log_path = log_path
        self.host = host
        self.health_path = health_path
        self.port = port or free_port(host)
        self.popen: subprocess.Popen | None = None
        self._lifeline: int | None = None
        self._url: str | None = None

    @classmethod
    def external(cls, url: str) -> ServerProcess:
        proc = cls(name=url, command=None, env={}, log_path=None, port=1)
        proc._url = url.rstrip("/")
        return proc

    @property
    def url(self) -> str:
        return self._url or f"http://{self.host}:{self.port}"

    @property
    def launched(self) -> bool:
        return self.command is not None

    def launch(self) -> None:
        if not self.launched:
            return
        if self.is_alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.popen.pid})")
        cmd = self.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {' '.join(cmd)}\n".encode())
            log.flush()
            # The watchdog leads the new session and takes the server's whole process tree down when the write end
            # of this lifeline pipe closes, i.e. when this process is gone however it died.
            lifeline_r, self._lifeline = os.pipe()
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "fully_async.engines.watchdog", str(lifeline_r), "--", *cmd],
                pass_fds=(lifeline_r,),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
            )
        os.close(lifeline_r)
        _LIVE.add(self)
        logger.info("launched %s (pid %d) at %s, log %s", self.name, self.popen.pid, self.url, self.log_path)

    def tail(self, lines: int = 40) -> str:
        """The last lines of this server's log (the same call as RemoteServer.tail, read on the server's node)."""
        return tail(self.log_path, lines)

    def is_alive(self) -> bool:
        """True for a launched process that has not exited; external servers count as alive."""
        if not self.launched:
            return True
        return self.popen is not None and self.popen.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Block until the health endpoint answers 200; raise with the log tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.launched and not self.is_alive():
                raise EngineError(
                    f"{self.name} at {self.url} exited with code {self.popen.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        raise EngineError(
            f"{self.name} at {self.url} not healthy after {timeout_s:.0f} s (engine.startup_timeout_s); "
            f"log {self.log_path}:\n{tail(self.log_path)}"
        )

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after grace_s. No-op for external or already stopped servers."""
        if self.popen is None:
            return
        popen, self.popen = self.popen, None
        _LIVE.discard(self)
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(popen.pid, sig)
            except ProcessLookupError:
                break  # the whole group is gone
            try:
                popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader exited; children (engine core, workers) may linger a moment: make sure the group is empty.
            if not _group_gone(popen.pid, 5.0):
                continue
            break
        logger.info("stopped %s (pid %d)", self.name, popen.pid)


def _group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def node_of(proc: Any) -> dict[str, Any]:
    """{"node_id", "node_ip", "host"} of a server process: a `RemoteServer`'s engine host node and handle
    (engines/host.py); node_id None for a child of this process or a server attached by address (this process's
    node)."""
    if hasattr(proc, "node"):  # a RemoteServer: its engine host's node
        return {**proc.node, "host": proc.host}
    return {"node_id": None, "node_ip": None, "host": None}
