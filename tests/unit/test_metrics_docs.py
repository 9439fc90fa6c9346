"""docs/metrics.md documents every metric a run logs (the recorded run's metrics.jsonl plus the rows only some steps
log), either by name or through a `family/*` row."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ONLY_SOME_STEPS = ["timing_s/validation", "val/reward_mean", "val/n", "val/version", "timing_s/final_validation", "trainer/skipped", "timing_s/save_checkpoint",
                   "fully_async/engines/pool_size", "fully_async/engines/pool_down", "timing_s/param_sync/verify",
                   "fully_async/param_sync/verified_servers", "fully_async/engines/prefix_cache_hit_rate",
                   "agent/no_calls", "gateway/ignored_keys", "fully_async/routing/stayed_ratio",
                   "fully_async/routing/sessions_moved"]  # fmt: skip
"""Logged by some steps or runs only (the recorded run predates the engine pool's metrics and the sync's proof)."""


def documented() -> tuple[set[str], list[str]]:
    table = [
        line for line in (REPO / "docs" / "metrics.md").read_text().splitlines() if line.startswith(("| `", "| **`"))
    ]
    names: set[str] = set()
    families: list[str] = []
    previous = ""
    for line in table:
        first_cell = line.split(" | ")[0]
        for name in re.findall(r"`([^`]+)`", first_cell):
            if name.endswith("/*"):
                families.append(name[:-1])
            elif name.startswith("/"):  # `timing_s/param_sync/pause`, `/export`: a suffix of the name before it
                names.add(previous.rsplit("/", 1)[0] + name)
            else:
                names.add(name)
                previous = name
    return names, families


def test_every_logged_metric_is_in_docs_metrics_md():
    rows = [json.loads(line) for line in (REPO / "tests/data/recorded_run/metrics.jsonl").read_text().splitlines()]
    logged = {k for r in rows for k in r} | set(ONLY_SOME_STEPS)
    names, families = documented()
    missing = sorted(k for k in logged if k not in names and not any(k.startswith(f) for f in families))
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"
    assert "fully_async/rollouter/idle_ratio" in names and "timing_s/param_sync/resume" in names
