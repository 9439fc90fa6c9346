"""Runs a server as its child and makes sure the server and everything it spawned die with the launcher.

    python -m fully_async.engines.watchdog LAUNCHER_PID -- COMMAND...

Why: PR_SET_PDEATHSIG only covers the direct child and fires when the launching *thread* exits, and vLLM's engine
core is a grandchild that outlives a killed API server. The watchdog leads the server's process group; when the
launcher dies (polled), or when it receives SIGTERM/SIGINT (a normal stop), it SIGTERMs every other member of its
group, waits, then SIGKILLs what is left. When the server exits on its own, the watchdog reaps the group and exits
with the server's code. Standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


def _group_members() -> list[int]:
    me, group = os.getpid(), os.getpgid(0)
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
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


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m fully_async.engines.watchdog LAUNCHER_PID -- COMMAND...", file=sys.stderr)
        return 2
    launcher, command = int(argv[0]), argv[2:]
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(command)
    while child.poll() is None:
        # Our parent is the launcher; when it dies we are re-parented (a PID check could be fooled by PID reuse).
        if stop["requested"] or os.getppid() != launcher:
            _reap_group(child)
            return 0 if stop["requested"] else 1
        time.sleep(POLL_S)
    _reap_group(child)  # the server exited: its children go too
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
