"""The placement path on real GPUs (skipped without CUDA): the CPU twin of these checks, with GPUs declared on a
2-node loopback cluster, is tests/integration/test_cluster_job.py.

Needs at least 2 GPUs (trainer 1, engine 1), `bash scripts/setup.sh` on the GPU machine (vllm in .venv-engine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1800)]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # a CPU build of torch: no devices
        return 0


def _runner(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fully_async.runner", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_plan_on_this_gpu_machine_refuses_a_run_that_needs_more_gpus_than_it_has():
    n = _gpus()
    out = _runner("--plan", f"trainer.n_gpus_per_node={n}", "engine.num_servers=1", timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"needs {n + 1} GPUs" in out.stderr and f"cluster has {n} GPUs" in out.stderr, out.stderr


def test_short_job_puts_trainer_and_engine_on_disjoint_gpus(tmp_path):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs: one for the trainer, one for the engine")
    out = _runner("trainer.total_steps=5", "engine.num_servers=1", f"hydra.run.dir={tmp_path}", "logger=[jsonl]")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads((tmp_path / "placement.json").read_text())
    assert record["gpu"] is True
    engine_gpus = {g for e in record["engines"] for g in (e["cuda_visible_devices"] or "").split(",") if g}
    trainer_gpus = {g for r in record["trainer_ranks"] for g in (r["cuda_visible_devices"] or "").split(",") if g}
    assert engine_gpus and trainer_gpus and not engine_gpus & trainer_gpus, record
