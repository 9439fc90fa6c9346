"""One engine server process: launch on a free port, wait for health, stop with its whole process group.

Hygiene contract: a launched server never outlives the process that launched it, even when that process is
SIGKILLed. The server runs under `fully_async.engines.watchdog` in its own session: stop() signals the group; the
watchdog holds the read end of a lifeline pipe whose write end only this process holds and, when it closes, takes
the server and every child it spawned (vLLM's engine core) down. PR_SET_PDEATHSIG is set too where it works (launched from the main thread), and an atexit hook stops whatever
is still running when the interpreter exits.

Shared memory: a vLLM-CPU server maps ~400 MiB of files under /dev/shm (Python's `psm_*` segments of its
message queues, `sem.mp-*` semaphores) that it removes only when it shuts down cleanly; a killed server (SIGKILL,
its node lost) leaves them. So a healthy server's record (`<log>.shm.json`: name, inode and size of every /dev/shm
file its process group maps) is written beside its log, and the files in it are removed once no process maps them:
when the server stops, when a server is launched again under the same log (a restart in place, or a replacement on
another engine host), and when the pool stops. Only files a server of ours mapped are ever removed, and only the very
files (same inode and size) while no live process maps them; a record from another machine names nothing here.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fully_async.engines import watchdog
from fully_async.engines.errors import EngineError

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()

SHM = Path("/dev/shm")

REPLACED_GRACE_S = 2.0
"""Seconds a server being restarted (its pool set it aside: dead, hung, or failing) has to exit on SIGTERM before
SIGKILL. Its requests already went on on the other servers, so a clean shutdown saves nothing; vLLM's HTTP server,
continued after a hang, otherwise spends ~10 s on it. Its /dev/shm segments are released all the same."""


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
        release_shm(shm_record(self.log_path))  # what the previous server under this log left (killed, or its node)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {' '.join(cmd)}\n".encode())
            log.flush()
            # The watchdog leads the new session and takes the server's whole process tree down when the write end
            # of this lifeline pipe closes, i.e. when this process is gone however it died.
            lifeline_r, self._lifeline = os.pipe()
            self.popen = subprocess.Popen(
                watchdog.command(lifeline_r, cmd),
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
                self.record_shm()
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
        self.record_shm()  # segments made since it became healthy, too
        popen, self.popen = self.popen, None
        _LIVE.discard(self)
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(popen.pid, sig)
                # A stopped server (SIGSTOP, a hung one set aside) holds SIGTERM pending until it runs again: continue
                # it, so it shuts down cleanly now instead of after the whole grace period.
                os.killpg(popen.pid, signal.SIGCONT)
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
        release_shm(shm_record(self.log_path))
        logger.info("stopped %s (pid %d)", self.name, popen.pid)

    def record_shm(self) -> None:
        """Add the /dev/shm files the server's process group maps now to its record (see the module docstring)."""
        if self.popen is None or self.log_path is None:
            return
        path = shm_record(self.log_path)
        known = {e["name"]: e for e in _read_record(path)}
        known.update((e["name"], e) for e in _shm_of_group(self.popen.pid))
        if known:
            path.write_text(json.dumps(sorted(known.values(), key=lambda e: e["name"])))


def shm_record(log_path: Path) -> Path:
    """Where the record of the /dev/shm files of the server logging to `log_path` is kept."""
    return log_path.with_suffix(".shm.json")


def release_shm(record: Path) -> list[str]:
    """Remove the /dev/shm files named in `record` that are still the same files (inode and size) and that no live
    process maps; then the record. Returns the names removed. A file some process still maps stays, and so does the
    record of it."""
    entries = _read_record(record)
    if not entries:
        return []
    mapped = _mapped_shm()
    removed, kept = [], []
    for e in entries:
        path = SHM / e["name"]
        try:
            st = path.stat()
        except OSError:
            continue  # gone already (the server cleaned up, or another launch did)
        if (st.st_ino, st.st_size) != (e["ino"], e["size"]):
            continue  # another file under that name now: not ours
        if e["name"] in mapped:
            kept.append(e)
            continue
        try:
            path.unlink()
            removed.append(e["name"])
        except OSError as err:
            logger.warning("shared memory %s of a stopped engine server not removed: %s", path, err)
    if kept:
        record.write_text(json.dumps(kept))
    else:
        record.unlink(missing_ok=True)
    if removed:
        mib = sum(e["size"] for e in entries if e["name"] in removed) / 2**20
        logger.info("removed %d shared-memory file(s) (%.0f MiB) a stopped engine server left: %s", len(removed),
                    mib, record.name)  # fmt: skip
    return removed


def _read_record(path: Path) -> list[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def _shm_of_group(pgid: int) -> list[dict[str, Any]]:
    """Name, inode and size of every /dev/shm file a live member of process group `pgid` maps."""
    names: set[str] = set()
    for pid in _pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except OSError:
            continue
        names |= _maps_shm(pid)
    out = []
    for name in sorted(names):
        try:
            st = (SHM / name).stat()
        except OSError:
            continue
        out.append({"name": name, "ino": st.st_ino, "size": st.st_size})
    return out


def _mapped_shm() -> set[str]:
    """Names of the /dev/shm files any live process (that this user may read) maps."""
    names: set[str] = set()
    for pid in _pids():
        names |= _maps_shm(pid)
    return names


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _maps_shm(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps (not those unlinked already), by name."""
    prefix = f"{SHM}/"
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if prefix in line}
    except (OSError, IndexError):
        return set()
    return {
        p[len(prefix) :]
        for p in paths
        if p.startswith(prefix) and not p.endswith("(deleted)") and "/" not in p[len(prefix) :]
    }


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
