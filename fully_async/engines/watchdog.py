"""Runs a server so that it, and everything it spawns, dies with the process that launched it.

    python -I fully_async/engines/watchdog.py LIFELINE_FD -- COMMAND...   (watchdog.command builds it)

Why: PR_SET_PDEATHSIG covers only the direct child and fires when the launching *thread* exits; vLLM's engine core
is a grandchild that outlives a killed API server; and Ray SIGKILLs the direct children of a worker that exits, so
a watchdog that is a direct child dies before it can act. Here the direct child is a relay: it forks the real
watchdog and only waits for it (its exit code is the server's). The watchdog leads the server's process group and
watches LIFELINE_FD, the read end of a pipe whose write end only the launcher holds: EOF means the launcher is gone,
however it died. Then, or on SIGTERM/SIGINT (a normal stop), it SIGTERMs every other member of its group, waits,
and SIGKILLs what is left. When the server exits on its own, the group is reaped and its exit code passed on.
Standard library only.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

POLL_S = 0.5
GRACE_S = 10.0


def command(lifeline_fd: int, argv: Sequence[str]) -> list[str]:
    """The command line that runs `argv` under this watchdog: this file by its path, isolated (-I). Not `-m
    fully_async.engines.watchdog`, which imports the package's __init__ first (0.8 CPU-s per launch here, paid by every
    gateway episode's agent process); -I also keeps this file's folder off sys.path, where engines/types.py would
    stand in for the standard library's `types`."""
    return [sys.executable, "-I", str(Path(__file__).resolve()), str(lifeline_fd), "--", *argv]


def _group_members() -> list[int]:
    """Our process group without us and without the relay (our parent), which exits when we do."""
    skip, group = {os.getpid(), os.getppid()}, os.getpgid(0)
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in skip:
            try:
                if os.getpgid(int(entry)) == group:
                    out.append(int(entry))
            except (ProcessLookupError, PermissionError):
                continue
    return out


def _signal_group(sig: int) -> None:
    for pid in _group_members():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


def _reap_group(child: subprocess.Popen) -> None:
    _signal_group(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and (child.poll() is None or _group_members()):
        time.sleep(0.1)
    _signal_group(signal.SIGKILL)
    child.wait()


def _watch(lifeline: int, command: list[str]) -> int:
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(command)
    while child.poll() is None:
        readable, _, _ = select.select([lifeline], [], [], POLL_S)
        launcher_gone = bool(readable) and os.read(lifeline, 1) == b""
        if stop["requested"] or launcher_gone:
            _reap_group(child)
            return 0 if stop["requested"] else 1
    _reap_group(child)  # the server exited: its children go too
    return child.returncode


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -I watchdog.py LIFELINE_FD -- COMMAND...", file=sys.stderr)
        return 2
    lifeline, command = int(argv[0]), argv[2:]
    pid = os.fork()
    if pid == 0:
        os._exit(_watch(lifeline, command))
    # The relay: nothing to do but wait. A normal stop signals the whole group; the watchdog does the work.
    os.close(lifeline)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
