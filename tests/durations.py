"""The suite's wall time per test file, recorded by one run and read by the next to hand the slowest files out
first.

With two pytest workers taking whole files (`--dist loadfile`), a file of ten minutes handed out last runs alone at
the end while the other worker idles. Ordering files by their recorded time, longest first (xdist's own reorder, by
test count, is turned off in scripts/test.sh), makes the two workers finish close together. A file missing from the
record (new) counts as DEFAULT_S. Record a run with FULLY_ASYNC_TEST_DURATIONS=tests/durations.json."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

RECORD = Path(__file__).with_name("durations.json")
DEFAULT_S = 30.0
"""Seconds a file missing from the record is taken to need (new files go ahead of the many quick unit files)."""


def load(path: Path = RECORD) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):  # no record yet, or a broken one: collection order is kept
        return {}


def longest_first(items: list, record: dict[str, float]) -> None:
    """Reorder `items` (pytest items) in place: files by recorded seconds, longest first; tests within a file, and
    files of equal time, keep their collected order."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))
    items.sort(key=lambda it: (-record.get(f := it.nodeid.split("::")[0], DEFAULT_S), first_seen[f]))


class Recorder:
    """Sums each file's setup, call and teardown seconds from the test reports (on the xdist controller, which sees
    every worker's reports) and writes them at the end of the session."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self, session) -> None:
        rounded = {f: round(s, 1) for f, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        self.out.write_text(json.dumps(rounded, indent=1) + "\n")


def register(config) -> None:
    """Record this run's file times where FULLY_ASYNC_TEST_DURATIONS says (never from an xdist worker)."""
    out = os.environ.get("FULLY_ASYNC_TEST_DURATIONS")
    if out and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Recorder(out), "fully-async-durations")
