"""A vLLM-CPU server of the tiny Qwen2-VL split over 2 tensor-parallel ranks (engine.tensor_parallel_size=2, each rank
on its own core: VLLM_CPU_OMP_THREADS_BIND="0|1" on 2 cores) takes a collective sync over gloo, then a disk reload:
the CPU twin of the TP=2 case in tests/gpu/test_vlm_gpu.py (nccl there), same code, only the backend, the dtype and
the reference differ. Marked `long`: a server start of its own (~2-3 min here).

- the weight group's world is 1 + 2: the sender and each rank; every rank receives whole tensors (the language model
  of `target`, not one tower tensor) and loads its own shard; each rank's digest of what it loaded is the sender's;
- the disk transport's reload of `start` then reaches both ranks the same way (each rank's digest again);
- after each, greedy tokens on image prompts equal transformers' float32 forward of the same weights, log-probs
  within 1e-4, labelled with the version.
"""

from __future__ import annotations

import asyncio

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import build_engine
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync
from fully_async.training.vision_tower import is_tower
from fully_async.weights.verify import ask_engines
from tests.fakes import ServersRollouter
from tests.integration.test_vlm_lora_sync import generate_images, hf_greedy, image_prompts
from tests.integration.test_vlm_weights_collective import (
    WholeModelBackend,
    frozen_tower_backend,
    language_digest,
    sync_once,
    vlm_pair,
)

pytestmark = [pytest.mark.long, pytest.mark.timeout(1200), pytest.mark.needs_venv(".venv-engine")]

TP = 2


def _transformers_outputs(model_dir, prompts):
    import torch
    from transformers import AutoModelForImageTextToText

    module = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return [hf_greedy(module, model_dir, ids, images) for ids, images in prompts]


def _assert_serves(servers, prompts, want, version):
    got = asyncio.run(generate_images(servers, prompts))
    for r, (tokens, logprobs) in zip(got, want, strict=True):
        assert list(r.token_ids) == tokens and set(r.versions) == {version}
        assert max(abs(a - b) for a, b in zip(r.logprobs, logprobs, strict=True)) < 1e-4


def rank_digests(handle) -> list[str]:
    """What each rank of the one server reports it loaded last (fa_loaded_digest), one entry per rank."""
    (workers,) = ask_engines(handle, "fa_loaded_digest", {}).values()
    return [w["digest"] for w in workers]


def test_a_tp2_cpu_server_of_the_vlm_takes_a_collective_sync_and_a_disk_reload(tmp_path_factory, tmp_path):
    start, target = vlm_pair(tmp_path_factory.mktemp("models"))
    prompts = image_prompts(start)
    want_start, want_target = _transformers_outputs(start, prompts), _transformers_outputs(target, prompts)
    assert [w[0] for w in want_start] != [w[0] for w in want_target]  # the two models disagree
    cfg = EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=900, dtype="float32",
                       tensor_parallel_size=TP)  # fmt: skip
    servers = build_engine(cfg, start, tmp_path_factory.mktemp("run"), device="cpu")
    assert servers.kind.workers_per_server == TP and "--tensor-parallel-size" in servers.kind.command(0, 1)
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    try:
        _assert_serves(servers, prompts, want_start, 0)  # split over 2 ranks, it answers as the whole model does
        # Collective (gloo): world 1 + TP, each rank takes every tensor whole and loads its shard. The sender is
        # handed the whole model, tower included, and leaves the frozen tower out itself.
        timings, sent, _, wire = sync_once(handle, WholeModelBackend(target, device="cpu"), tmp_path, "float32", "cpu")
        assert timings["fully_async/param_sync/verified_servers"] == 1.0
        assert sent and not [n for n in sent if is_tower(n)] and wire["digest"] == language_digest(target)
        digests = rank_digests(handle)
        assert len(digests) == TP and len(set(digests)) == 1 and digests[0]
        _assert_serves(servers, prompts, want_target, 1)
        # Disk: both ranks reload `start` from the directory the sync writes.
        sync = ParamSync(handle, frozen_tower_backend(start, "cpu"), tmp_path / "disk", "float32", 120.0)
        try:
            assert sync.sync(2)["fully_async/param_sync/verified_servers"] == 1.0
        finally:
            sync.close(remove=False)
        reloaded = rank_digests(handle)
        assert len(reloaded) == TP and len(set(reloaded)) == 1 and reloaded[0] != digests[0]
        _assert_serves(servers, prompts, want_start, 2)
    finally:
        handle.close()
        servers.stop()
