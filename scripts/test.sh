#!/usr/bin/env bash
# The test command (README, CI): set-up (idempotent), lint, format check, verl patches check, then pytest.
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh tests/unit -x   # extra arguments go to pytest
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
echo "[test] ruff check + format check" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ -x scripts/apply_verl_patches.sh ]; then
    scripts/apply_verl_patches.sh --check
fi
echo "[test] pytest $*" >&2
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "[test] ERROR: pytest collected no tests" >&2
fi
exit "$rc"
