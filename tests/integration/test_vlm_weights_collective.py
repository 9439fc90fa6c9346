"""The tiny Qwen2-VL's full-weight sync over the collective transport (gloo) into a REAL vLLM-CPU server, the frozen
tower left out by the sender itself (CollectiveSender(tower_frozen=True), handed the whole model): the CPU twin of
tests/gpu/test_vlm_gpu.py (same code, only the backend, the dtype and the reference differ). Marked `long`: a server
start of its own (the image path's sync is checked in the default run by tests/integration/test_vlm_engine_trainer.py
over the disk transport).

The server starts on one tiny Qwen2-VL (`start`) and receives the language model of another (`target`: the start's
tower, another seed's language model); its greedy tokens and log-probs on image prompts then equal transformers'
float32 forward of `target` within 1e-4, labelled with the new version, and no tower tensor went over the wire
(the sender's bytes and digest are the language model's, the engine proved it loaded that digest).
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from fully_async.config import EngineConfig, TinyModelConfig
from fully_async.engines import build_engine
from fully_async.handles import LocalActor
from fully_async.models import build_tiny_model
from fully_async.sync import ParamSync
from fully_async.training.vision_tower import is_tower, without_tower
from fully_async.weights.collective import CollectiveTransport
from fully_async.weights.collective_sender import CollectiveSender
from tests.fakes import ServersRollouter, StateDictBackend
from tests.integration.test_vlm_lora_sync import _model_bytes, generate_images, hf_greedy, image_prompts

pytestmark = [pytest.mark.long, pytest.mark.timeout(900), pytest.mark.needs_venv(".venv-engine")]

SYNC_TIMEOUT_S = 40.0


def vlm_pair(cache):
    """(start, target): a tiny Qwen2-VL, and a copy of it whose language model is another seed's (its tower is the
    start's: a frozen tower is never sent, so the engine keeps the one it started with)."""
    from safetensors.torch import load_file, save_file

    start = build_tiny_model(TinyModelConfig(arch="qwen2_vl"), cache)
    other = build_tiny_model(TinyModelConfig(arch="qwen2_vl", seed=1), cache)
    target = cache / "target"
    if not target.exists():
        shutil.copytree(start, target)
        ours, theirs = load_file(str(start / "model.safetensors")), load_file(str(other / "model.safetensors"))
        mixed = {n: (t if is_tower(n) else theirs[n]).contiguous() for n, t in ours.items()}
        save_file(mixed, str(target / "model.safetensors"), metadata={"format": "pt"})
    return start, target


class WholeModelBackend(StateDictBackend):
    """The trainer's stand-in holding every tensor of a model, the tower's included, with the tower frozen: its
    collective sender is built as the verl worker builds it (tower_frozen=True) and decides itself what to send."""

    def weight_sender(self):
        self.sender = CollectiveSender(self.named_tensors, self.device, tower_frozen=True)
        return self.sender


def frozen_tower_backend(target, device: str) -> StateDictBackend:
    """The trainer's stand-in for the disk transport: `target`'s tensors without the tower, what the verl worker's
    sync export writes with the tower frozen (its own filter; the collective path's is the sender's)."""
    backend = StateDictBackend(target, device=device)
    backend.state = dict(without_tower(backend.state.items()))
    return backend


def language_digest(model_dir, dtype: str = "float32") -> str:
    """fa_digest of `model_dir`'s tensors without the tower's, cast to `dtype`: what a sync with the tower frozen
    must put on the wire and the engine must prove it loaded."""
    import torch
    from safetensors.torch import load_file

    from fully_async.vllm_ext.fa_digest import digest

    cast = getattr(torch, dtype)
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return digest((n, t.to(cast)) for n, t in tensors.items() if not is_tower(n))


def sync_once(handle, backend, tmp_path, dtype: str, device: str) -> tuple[dict, list[str], int, dict]:
    """One collective sync as version 1: (its timings, the names of the tensors that went over the wire, their
    bytes in `dtype`, the sender's report of the send: bytes and digest)."""
    from fully_async.weights.collective_sender import staging_bytes

    transport = CollectiveTransport(handle, backend, tmp_path / "w", dtype, bucket_mb=1,
                                    sync_timeout_s=SYNC_TIMEOUT_S, device=device)  # fmt: skip
    sync = ParamSync(handle, backend, tmp_path / "w", dtype, SYNC_TIMEOUT_S, transport=transport)
    try:
        timings = sync.sync(1)
    finally:
        sync.close(remove=False)
    plan = backend.sender.plan()  # what the sender announced: the engines checked it, then received it
    return timings, [name for name, _ in plan], staging_bytes(plan, dtype), transport.last["sender"]


def test_a_collective_sync_of_the_vlm_serves_the_targets_image_outputs_and_sends_no_tower(tmp_path_factory, tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    start, target = vlm_pair(tmp_path_factory.mktemp("models"))
    prompts = image_prompts(start)
    module = AutoModelForImageTextToText.from_pretrained(str(target), dtype=torch.float32).eval()
    want = [hf_greedy(module, target, ids, images) for ids, images in prompts]
    cfg = EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=600, dtype="float32")
    servers = build_engine(cfg, start, tmp_path_factory.mktemp("run"))
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    try:
        before = asyncio.run(generate_images(servers, prompts))
        assert [list(r.token_ids) for r in before] != [w[0] for w in want]  # the two models disagree
        backend = WholeModelBackend(target, device="cpu")  # the whole model, tower included: the sender leaves it out
        assert [n for n in backend.state if is_tower(n)]
        timings, sent, sent_bytes, wire = sync_once(handle, backend, tmp_path, "float32", "cpu")
        assert timings["fully_async/param_sync/verified_servers"] == 1.0  # the engine loaded what the sender sent
        # Over the wire: the language model's tensors, every one, and not one of the tower's.
        total, language = _model_bytes(target)
        assert sent and not [n for n in sent if is_tower(n)] and sent_bytes == language < total
        assert wire["bytes"] == language and wire["digest"] == language_digest(target)
        print(f"\nVLM collective sync: {sent_bytes} of {total} bytes (tower frozen); {timings}")
        got = asyncio.run(generate_images(servers, prompts))
        for r, (tokens, logprobs) in zip(got, want, strict=True):
            assert list(r.token_ids) == tokens and set(r.versions) == {1}
            assert max(abs(a - b) for a, b in zip(r.logprobs, logprobs, strict=True)) < 1e-4
    finally:
        handle.close()
        servers.stop()
