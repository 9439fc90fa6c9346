#!/usr/bin/env bash
# The test command (README, CI): set-up (idempotent), lint, format check, import contracts, verl patches check, then
# pytest.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/unit -x   # extra arguments go to pytest
#   FULLY_ASYNC_TEST_WORKERS=1 bash scripts/test.sh   # one pytest process (default: 2, a file per worker at a time)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
echo "[test] ruff check + format check" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The layers and no-circle contracts in pyproject.toml ([tool.importlinter]); no cache, so a stale one never hides
# a circle (the graph builds in under a second).
echo "[test] import contracts (lint-imports)" >&2
.venv/bin/lint-imports --no-cache --no-logo
if [ -x scripts/apply_verl_patches.sh ]; then
    scripts/apply_verl_patches.sh --check
fi
# Two workers by default, each taking whole files (pytest-xdist --dist loadfile: a module's fixtures and its tests'
# order stay together): two thirds of the suite's wall time is waiting (engine and Ray start-up, sleeps on deadlines),
# so a second process overlaps it on the same 2 cores. Each worker holds its own session fixtures (Ray, engines).
# Files go out longest first by their recorded seconds (tests/durations.py); xdist's own reorder, by test count,
# put the 10-minute one-test files last, alone at the end of a worker.
workers="${FULLY_ASYNC_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" -gt 1 ]; then
    parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
echo "[test] pytest ${parallel[*]} $*" >&2
set +e
.venv/bin/python -m pytest "${parallel[@]}" "$@"
rc=$?
set -e
# A process the tests started that outlives them while holding this script's output keeps a CI runner (which reads
# until the output closes) waiting with nothing printed. Name each one (it is a bug to fix) and end it, by pid.
leftovers="$(.venv/bin/python scripts/leftovers.py --since-pid $$ 2>/dev/null || true)"
if [ -n "$leftovers" ]; then
    echo "[test] WARNING: processes started by the tests still hold the test output; ending them:" >&2
    echo "$leftovers" >&2
    for pid in $(echo "$leftovers" | awk '{print $1}'); do kill -9 "$pid" 2>/dev/null || true; done
fi
if [ "$rc" -eq 5 ]; then
    echo "[test] ERROR: pytest collected no tests" >&2
fi
exit "$rc"
