"""Trainer log-probs (verl backend, CPU, float32) against the vLLM-CPU engine's behaviour log-probs for the same
weights, before and after a weight export -> engine reload (the disk transport)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fully_async.config import AlgorithmConfig, EngineConfig, TinyModelConfig, TrainerConfig
from fully_async.engines.vllm import REPO_ROOT
from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not (REPO_ROOT / ".venv-engine/bin/python").exists(), reason="engine venv missing"),
]

TEMPERATURE = 0.8
PROMPTS = [list(b"12+34="), list(b"hello"), list(b"7*8 is"), list(b"<a>")]


async def _sample(servers, n=2, tokens=16, version=0):
    from fully_async.engines import EngineClient, Sampling

    client = EngineClient(servers)
    try:
        groups = []
        for i, prompt in enumerate(PROMPTS):
            ref = PromptRef(0, i)
            outs = await asyncio.gather(
                *(client.generate(prompt, tokens, Sampling(temperature=TEMPERATURE, seed=10 * i + s, ignore_eos=True))
                  for s in range(n))
            )  # fmt: skip
            trajs = [
                Trajectory(
                    prompt=ref,
                    sample_index=s,
                    prompt_ids=np.array(prompt),
                    response_ids=np.array(o.token_ids),
                    behaviour_logprobs=np.array(o.logprobs),
                    token_versions=np.array(o.versions),
                    reward=float(s),
                )  # fmt: skip
                for s, o in enumerate(outs)
            ]
            assert all(t.min_version == version for t in trajs)
            groups.append(TrajectoryGroup(ref, trajs))
        return groups
    finally:
        await client.close()


def test_trainer_log_probs_match_engine_before_and_after_a_weight_sync(ray_local, tmp_path):
    from fully_async.engines import build_engine
    from fully_async.models import build_tiny_model
    from fully_async.protocol import flatten
    from fully_async.training import build_backend

    model = build_tiny_model(TinyModelConfig(init_std=0.1), tmp_path / "models")
    servers = build_engine(
        EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=240, dtype="float32"),
        model,
        tmp_path / "run",
    )
    servers.start()
    backend = build_backend(
        TrainerConfig(max_token_len_per_gpu=256, lr=1e-2),
        AlgorithmConfig(),
        model,
        temperature=TEMPERATURE,
        device="cpu",
    )
    try:

        def gap(groups):
            trainer = backend.compute_log_probs(groups)
            return max(
                float(np.abs(t.behaviour_logprobs - lp).max()) for t, lp in zip(flatten(groups), trainer, strict=True)
            )

        groups = asyncio.run(_sample(servers))
        assert gap(groups) < 1e-4

        backend.update(groups)  # new weights, then push them to the engine as version 1
        backend.export_weights(tmp_path / "w1", dtype="float32")

        async def reload():
            await servers.pause("abort")
            await servers.load_weights(tmp_path / "w1", 1)
            await servers.resume()

        asyncio.run(reload())
        fresh = asyncio.run(_sample(servers, version=1))
        assert gap(fresh) < 1e-4
        # The update moved the policy: the old samples' engine log-probs no longer match the trainer.
        assert gap(groups) > 1e-3
    finally:
        backend.shutdown()
        servers.stop()
