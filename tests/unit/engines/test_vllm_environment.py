"""The vLLM adapter's server environment without a server (fully_async/engines/vllm.py): a CPU server runs its one
worker inside the EngineCore process, a GPU server keeps vLLM's own executor choice, and engine.env still wins. What
it saves and that the numerics do not move: scripts/bench/engine_launch.py; the real server:
tests/integration/test_trainer_engine_logprobs.py."""

from __future__ import annotations

import sys

from fully_async.config import EngineConfig
from fully_async.engines import build_engine


def _env(tmp_path, device, **kw):
    return build_engine(EngineConfig(python=sys.executable, **kw), tmp_path, tmp_path, device=device).kind.environment(
        0
    )


def test_a_cpu_server_runs_its_worker_in_the_engine_core_process(tmp_path):
    env = _env(tmp_path, "cpu")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"]  # the worker still binds its threads (vLLM's CPU worker does it)


def test_a_gpu_server_keeps_the_multiprocess_executor(tmp_path):
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in _env(tmp_path, "cuda")


def test_engine_env_overrides_the_worker_placement(tmp_path):
    env = _env(tmp_path, "cpu", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
