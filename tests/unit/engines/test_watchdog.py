"""The engine watchdog takes a whole process tree down when its launcher is SIGKILLed, and on a normal stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# A "server" that spawns a grandchild in its own process group member list (like vLLM's engine core) and sleeps.
SERVER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
# A launcher that starts the server under the watchdog with a lifeline pipe, prints the relay's pid, then waits.
LAUNCHER = f"""
import os, subprocess, sys, time
r, w = os.pipe()
from fully_async.engines import watchdog
p = subprocess.Popen(watchdog.command(r, [sys.executable, "-c", {SERVER!r}]), start_new_session=True, pass_fds=(r,))
os.close(r)
print(p.pid, flush=True)
time.sleep(600)
"""


def group_of(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid and "zombie" not in Path(f"/proc/{entry}/status").read_text().lower():
                    out.append(int(entry))
            except (ProcessLookupError, FileNotFoundError):
                continue
    return out


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def start_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    watchdog = int(launcher.stdout.readline())
    # relay + watchdog + server + grandchild
    assert wait_for(lambda: len(group_of(watchdog)) >= 4, 20), "server and grandchild did not start"
    return launcher, watchdog


def test_sigkilled_launcher_takes_the_whole_server_tree_down():
    launcher, watchdog = start_launcher()
    launcher.kill()
    launcher.wait()
    assert wait_for(lambda: not group_of(watchdog), 20), f"left running: {group_of(watchdog)}"


def test_ray_style_kill_of_the_direct_child_then_the_launcher():
    # Ray SIGKILLs a dead worker's direct children: the relay goes first, the watchdog must still clean up.
    launcher, relay = start_launcher()
    os.kill(relay, signal.SIGKILL)
    time.sleep(1.0)
    assert len(group_of(relay)) >= 3, "losing the relay must not stop the server while the launcher lives"
    launcher.kill()
    launcher.wait()
    assert wait_for(lambda: not group_of(relay), 20), f"left running: {group_of(relay)}"


def test_sigterm_to_the_group_stops_server_and_grandchildren():
    launcher, watchdog = start_launcher()
    try:
        os.killpg(watchdog, signal.SIGTERM)
        assert wait_for(lambda: not group_of(watchdog), 20), f"left running: {group_of(watchdog)}"
    finally:
        launcher.kill()
        launcher.wait()


def test_the_watchdog_starts_without_importing_the_package():
    # The gateway starts one watchdog per episode: its start-up must be the interpreter's, not fully_async's
    # (-m fully_async.engines.watchdog imported the package's __init__, 0.8 CPU-s a launch: aiohttp, numpy, ...).
    from fully_async.engines import watchdog

    r, w = os.pipe()
    relay = subprocess.Popen(watchdog.command(r, [sys.executable, "-c", "import time; time.sleep(60)"]),
                             pass_fds=(r,), start_new_session=True)  # fmt: skip
    try:
        assert wait_for(lambda: len(group_of(relay.pid)) >= 3, 20), "the server did not start"
        maps = Path(f"/proc/{relay.pid}/maps").read_text()  # the relay: the watchdog's interpreter before its fork
        assert "aiohttp" not in maps and "numpy" not in maps
    finally:
        os.killpg(relay.pid, signal.SIGKILL)
        relay.wait()
        os.close(r)
        os.close(w)
