"""Processes started after a given process that hold its standard output or error (a pipe or file a CI runner reads
until it closes), excluding that process's ancestors and the output's readers: one line each, `PID COMMAND`. Used by scripts/test.sh after
pytest to find (and end) processes the tests left behind.

    python scripts/leftovers.py --since-pid PID
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _start(pid: int) -> int:
    """Start time of a process in clock ticks since boot (field 22 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def _ancestors(pid: int) -> set[int]:
    chain = set()
    while pid > 1:
        chain.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
    return chain


def leftovers(since_pid: int) -> list[tuple[int, str]]:
    targets = {os.readlink(f"/proc/{since_pid}/fd/{fd}") for fd in (1, 2)}
    targets = {t for t in targets if t.startswith("pipe:") or t.startswith("/")}
    skip = _ancestors(since_pid) | _ancestors(os.getpid())
    born = _start(since_pid)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        pid = int(entry.name)
        try:
            if _start(pid) < born:
                continue
            held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (1, 2)}
            if os.readlink(f"/proc/{pid}/fd/0") in targets:
                continue  # a reader of the output (the other end of a pipe), not a writer
            if held & targets:
                found.append(
                    (pid, (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200])
                )
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--since-pid", type=int, required=True)
    for pid, cmd in leftovers(parser.parse_args().since_pid):
        print(pid, cmd)


if __name__ == "__main__":
    main()
