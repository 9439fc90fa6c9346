"""The tiny Qwen2-VL's weight syncs into real vLLM GPU servers (skipped without CUDA): the twins of
tests/integration/test_vlm_weights_collective.py (the collective transport, nccl here, gloo there) and
tests/integration/test_vlm_lora_sync.py (LoRA's adapter-only sync), same code, only the backend, the dtype and the
reference differ (nccl in bf16: tokens against a fresh server of the same weights, as
tests/gpu/test_weights_collective_gpu.py does).

- nccl: the sender (this process) on cuda:0, the engine server on the next GPU (NCCL wants one device per rank: 2
  GPUs); the server starts on `start`, receives `target`'s language model (the frozen tower is never sent) and then
  answers image prompts as a fresh server of `target` does.
- nccl, TP=2: the same sync into a server split over 2 GPUs (engine.tensor_parallel_size=2; 3 GPUs: the sender
  keeps its own, as NCCL wants one device per rank): the weight group's world is 1 + 2, each rank receives whole
  tensors and loads its shard, each rank's digest is the sender's; a disk reload of `start` then brings back the
  server's own first answers. CPU twin: tests/integration/test_vlm_tensor_parallel.py (gloo, float32).
- adapter: a server of the VLM started with --enable-lora (1 GPU) takes a peft adapter of the language model through
  the adapter transport; its greedy tokens on image prompts equal transformers' merged model's (float32 here, in
  this process), and change with the next version.

Needs vLLM with CUDA in .venv-engine (`bash scripts/setup.sh` on the GPU machine).
"""

from __future__ import annotations

import asyncio

import pytest

from fully_async.config import EngineConfig
from fully_async.config.sections.model import LoraConfig
from fully_async.engines import build_engine
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync
from fully_async.training.vision_tower import is_tower
from fully_async.weights.lora import LoraServing
from tests.fakes import AdapterBackend, ServersRollouter
from tests.integration.test_vlm_lora_sync import _merged_greedy, generate_images, image_prompts
from tests.integration.test_vlm_tensor_parallel import rank_digests
from tests.integration.test_vlm_weights_collective import (
    WholeModelBackend,
    frozen_tower_backend,
    language_digest,
    sync_once,
    vlm_pair,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1200)]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # a CPU build of torch: no devices
        return 0


def _cfg(**env) -> EngineConfig:
    return EngineConfig(num_servers=1, max_model_len=256, startup_timeout_s=600, control_timeout_s=60,
                        gpu_memory_utilization=0.3, env=env)  # fmt: skip


def _fresh_outputs(cfg: EngineConfig, model, prompts, tmp_path_factory):
    """Greedy image outputs of a fresh GPU server of `model` (the bf16 reference), stopped before the test's own."""
    fresh = build_engine(cfg, model, tmp_path_factory.mktemp("fresh"), device="cuda")
    fresh.start()
    try:
        return asyncio.run(generate_images(fresh, prompts))
    finally:
        fresh.stop()


def test_an_nccl_sync_of_the_vlm_serves_a_fresh_servers_image_outputs_and_sends_no_tower(tmp_path_factory, tmp_path):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs: one for the sender (this process), one for the engine")
    start, target = vlm_pair(tmp_path_factory.mktemp("models"))
    prompts = image_prompts(start)
    cfg = _cfg(CUDA_VISIBLE_DEVICES="1")
    reference = _fresh_outputs(cfg, target, prompts, tmp_path_factory)
    servers = build_engine(cfg, start, tmp_path_factory.mktemp("run"), device="cuda")
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    try:
        backend = WholeModelBackend(target, device="cuda")  # the whole model: the sender leaves the tower out
        timings, sent, _, wire = sync_once(handle, backend, tmp_path, "bfloat16", "cuda")
        assert timings["fully_async/param_sync/verified_servers"] == 1.0
        assert sent and not [n for n in sent if is_tower(n)] and wire["digest"] == language_digest(target, "bfloat16")
        got = asyncio.run(generate_images(servers, prompts))
        for r, want in zip(got, reference, strict=True):
            assert list(r.token_ids) == list(want.token_ids) and set(r.versions) == {1}
            assert max(abs(a - b) for a, b in zip(r.logprobs, want.logprobs)) < 1e-2
    finally:
        handle.close()
        servers.stop()


def test_a_tp2_server_of_the_vlm_takes_an_nccl_sync_and_a_disk_reload(tmp_path_factory, tmp_path):
    if _gpus() < 3:
        pytest.skip("needs 3 GPUs: one for the sender (this process), two for the TP=2 engine")
    import dataclasses

    start, target = vlm_pair(tmp_path_factory.mktemp("models"))
    prompts = image_prompts(start)
    cfg = dataclasses.replace(_cfg(CUDA_VISIBLE_DEVICES="1,2"), tensor_parallel_size=2)
    reference = _fresh_outputs(cfg, target, prompts, tmp_path_factory)
    servers = build_engine(cfg, start, tmp_path_factory.mktemp("run"), device="cuda")
    assert servers.kind.workers_per_server == 2
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    try:
        first = asyncio.run(generate_images(servers, prompts))
        timings, sent, _, wire = sync_once(
            handle, WholeModelBackend(target, device="cuda"), tmp_path, "bfloat16", "cuda"
        )
        assert timings["fully_async/param_sync/verified_servers"] == 1.0
        assert sent and not [n for n in sent if is_tower(n)] and wire["digest"] == language_digest(target, "bfloat16")
        digests = rank_digests(handle)
        assert len(digests) == 2 and len(set(digests)) == 1 and digests[0]
        _assert_same(asyncio.run(generate_images(servers, prompts)), reference, 1)
        sync = ParamSync(handle, frozen_tower_backend(start, "cpu"), tmp_path / "disk", "bfloat16", 120.0)
        try:
            assert sync.sync(2)["fully_async/param_sync/verified_servers"] == 1.0
        finally:
            sync.close(remove=False)
        assert len(set(rank_digests(handle))) == 1
        _assert_same(asyncio.run(generate_images(servers, prompts)), first, 2)
    finally:
        handle.close()
        servers.stop()


def _assert_same(got, want, version: int) -> None:
    """Greedy tokens equal `want`'s (bf16: log-probs within 1e-2), labelled with `version`."""
    for r, w in zip(got, want, strict=True):
        assert list(r.token_ids) == list(w.token_ids) and set(r.versions) == {version}
        assert max(abs(a - b) for a, b in zip(r.logprobs, w.logprobs)) < 1e-2


def test_an_adapter_sync_into_a_vlm_server_serves_the_merged_models_image_tokens(tmp_path_factory, tmp_path):
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    import dataclasses

    start, _ = vlm_pair(tmp_path_factory.mktemp("models"))
    prompts = image_prompts(start)
    cfg = dataclasses.replace(_cfg(), dtype="float32")
    servers = build_engine(cfg, start, tmp_path_factory.mktemp("run"), device="cuda",
                           lora=LoraServing(max_loras=2, max_rank=8))  # fmt: skip
    assert "--enable-lora" in servers.kind.command(0, 1)
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    backend = AdapterBackend(start, LoraConfig(rank=8, alpha=16))
    sync = ParamSync(handle, backend, tmp_path / "w", "float32", 120.0, transport="adapter")
    try:
        sync.sync(1)
        v1 = asyncio.run(generate_images(servers, prompts))
        for (ids, images), got in zip(prompts, v1, strict=True):
            assert list(got.token_ids) == _merged_greedy(backend, start, ids, images)[0]
            assert set(got.versions) == {1}
        backend.step(2)
        sync.sync(2)
        v2 = asyncio.run(generate_images(servers, prompts))
        assert [r.token_ids for r in v2] != [r.token_ids for r in v1]
        assert all(set(r.versions) == {2} for r in v2)
    finally:
        sync.close()
        handle.close()
        servers.stop()
