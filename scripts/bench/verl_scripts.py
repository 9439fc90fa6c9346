"""How fast `python -m fully_async.runner ... --cfg job` answers a verl script's command line as verl ships it.

For every argument list in tests/data/verl_scripts/ (paths made local), the runner runs in a subprocess, as a user
types it; the baseline is `--cfg job` with no arguments in the same run (interpreter, imports, Hydra), so the ratio
says what reading verl's keys costs on top of what any command line costs. Prints one row per script (median of
--rounds wall seconds, rc, refused keys) and the worst.

    .venv/bin/python scripts/bench/verl_scripts.py
    .venv/bin/python scripts/bench/verl_scripts.py --rounds 3 --only fully_async_dapo
"""

from __future__ import annotations

import argparse
import re
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def answer(args: list[str], cwd: str) -> tuple[float, int, str]:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fully_async.runner", *args, "--cfg", "job"], cwd=cwd,
                         capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip
    return time.monotonic() - started, out.returncode, out.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="substring of the script names to run")
    a = ap.parse_args()
    where = tempfile.mkdtemp(prefix="verl_scripts_")
    paths = {k: f"{where}/{k.lower()}" for k in ("MODEL", "DATA", "CKPT", "TOOL_CONFIG")} | {
        "REWARD_FILE": f"{where}/r.py"
    }
    base = statistics.median(answer([], where)[0] for _ in range(a.rounds))
    print(f"baseline --cfg job, no arguments: {base:.2f} s (median of {a.rounds})")
    print(f"{'script':<58} {'args':>4} {'s':>6} {'/base':>6} rc  refused")
    worst = 0.0
    for path in sorted((REPO / "tests/data/verl_scripts").glob("*.args")):
        if a.only not in path.stem:
            continue
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        args = [string.Template(ln).substitute(paths) for ln in lines]
        runs = [answer(args, where) for _ in range(a.rounds)]
        seconds = statistics.median(r[0] for r in runs)
        rc, err = runs[-1][1], runs[-1][2]
        refused = sorted(set(re.findall(r"^(?:\s*\d+\.|ConfigError:) (\S+?)[= ]", err, re.M)))
        worst = max(worst, seconds)
        print(f"{path.stem:<58} {len(args):>4} {seconds:>6.2f} {seconds / base:>6.2f} {rc:>2}  {' '.join(refused)}")
    print(f"worst: {worst:.2f} s, {worst / base:.2f}x the baseline")


if __name__ == "__main__":
    main()
