"""A model that ties its word embeddings (issue 48: SmolLM2) through every path that moves the verl backend's weights,
with real Ray ranks on CPU (gloo): the disk transport's export (plain and staged), the collective transport's plan
and send, the LoRA adapter and its merged export, the HF export, and a resume from a checkpoint. Every path sends
the embedding once and no lm_head.weight (training/hf_files.without_tied_head), so what it sends fits the engine's
checkpoint, its digest is that of its files, and transformers loads it tied to the trained embedding with the
trainer's log-probs. The paths' untied cases are in test_verl_backend.py and test_verl_lora.py."""

from __future__ import annotations

import importlib.util
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open

from fully_async.config import AlgorithmConfig, LoraConfig, TinyModelConfig, TrainerConfig
from fully_async.engines.vllm import EXTENSION_DIR
from fully_async.vllm_ext.fa_digest import directory_digest, recorded_digest
from tests.training_data import hf_log_probs, load_hf_model, make_groups

TEMPERATURE = 0.9

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    from fully_async.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    return build_tiny_model(cfg, cache_dir=tmp_path_factory.mktemp("m"))


def _backend(model, ranks: int, lora: LoraConfig | None = None):
    from fully_async.training import build_backend

    trainer = TrainerConfig(n_gpus_per_node=ranks, max_token_len_per_gpu=512, total_steps=20, lr=1e-2)
    return build_backend(trainer, AlgorithmConfig(), model, temperature=TEMPERATURE, device="cpu", lora=lora)


@pytest.fixture(scope="module")
def be2(ray_local, tied_model):
    """Two ranks: every tensor, the shared embedding included, leaves sharded and is gathered."""
    backend = _backend(tied_model, 2)
    yield backend
    backend.shutdown()


def _headers(directory) -> dict[str, list[int]]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
    return out


def _assert_tied_export(out, model, groups, want):
    """`out` holds the model's tensors as its own files do (no lm_head.weight), its recorded digest is that of the
    files, and transformers loads it tied, giving the trainer's log-probs `want`."""
    assert _headers(out) == _headers(model)
    assert "lm_head.weight" not in _headers(out)
    assert recorded_digest(str(out)) == directory_digest(str(out))[0]
    hf = load_hf_model(out)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    for lp, lp_want in zip(hf_log_probs(hf, groups, TEMPERATURE), want, strict=True):
        np.testing.assert_allclose(lp, lp_want, atol=1e-5)


def test_the_disk_exports_and_the_hf_export_send_the_embedding_once_trained(be2, tied_model, tmp_path):
    groups = make_groups(2, 2, seed=3)
    be2.update(groups)  # trained weights: the export must carry the new embedding
    want = be2.compute_log_probs(groups)
    be2.export_weights(tmp_path / "sync", sync=True)
    _assert_tied_export(tmp_path / "sync", tied_model, groups, want)
    be2.stage_weights(tmp_path / "staged")()  # the background sync's export
    _assert_tied_export(tmp_path / "staged", tied_model, groups, want)
    be2.export_weights(tmp_path / "hf")  # trainer.save_hf
    _assert_tied_export(tmp_path / "hf", tied_model, groups, want)


def test_a_resumed_checkpoint_exports_what_it_saved_and_the_offline_export_gives_the_same(be2, tied_model, tmp_path):
    """Resume: the trainer loads its checkpoint (the module's state dict: the head under both names), the engines
    start from a sync export of it; `python -m fully_async.export` of the same checkpoint, and a resume at another
    world size, give the same tensors."""
    import json

    from fully_async.export import export_checkpoint

    groups = make_groups(2, 2, seed=5)
    be2.update(groups)
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    be2.save_checkpoint(ckpt / "backend", 1)
    (ckpt / "state.json").write_text(json.dumps({"config": {"model": {"path": str(tied_model)}}}))
    want = be2.compute_log_probs(groups)
    be2.update(make_groups(2, 2, seed=6))  # moves on, then resumes from the checkpoint
    be2.load_checkpoint(ckpt / "backend")
    be2.export_weights(tmp_path / "resumed", sync=True)
    _assert_tied_export(tmp_path / "resumed", tied_model, groups, want)
    export_checkpoint(ckpt, tmp_path / "offline", progress=None)
    _assert_tied_export(tmp_path / "offline", tied_model, groups, want)
    one = _backend(tied_model, 1)  # resumed at another world size: the shards joined, the head set with its embedding
    try:
        one.load_checkpoint(ckpt / "backend")
        one.export_weights(tmp_path / "resharded", sync=True)
        _assert_tied_export(tmp_path / "resharded", tied_model, groups, want)
    finally:
        one.shutdown()


def _receiver():
    spec = importlib.util.spec_from_file_location("fa_weight_receiver", EXTENSION_DIR / "fa_weight_receiver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_collective_plan_fits_the_engines_checkpoint_and_what_arrives_is_the_export(be2, tied_model, tmp_path):
    """The engine checks the plan against its checkpoint's headers (fa_check), which have no head for a tied
    model; the tensors sent (vLLM's worker extension receiving in a thread here) equal the disk export's, and the
    receiving worker's digest equals the sender's."""
    import json

    from fully_async.weights.collective_sender import layout_buckets

    receiver = _receiver()

    class _Runner:
        def __init__(self):
            self.loaded = {}

        def reload_weights(self, weights_iterator):
            self.loaded.update({name: t.clone() for name, t in weights_iterator})

    class _Worker(receiver.WeightReceiver):
        def __init__(self):
            self.model_config = type("C", (), {"model": str(tied_model)})()
            self.model_runner = _Runner()

    be2.update(make_groups(2, 2, seed=7))
    be2.export_weights(tmp_path / "ref", sync=True)
    sender = be2.weight_sender()
    plan = sender.plan()
    worker = _Worker()
    assert worker.fa_check(json.dumps({"tensors": plan})) == {"tensors": len(_headers(tied_model))}
    buckets = layout_buckets(plan, "float32", 64 << 10)
    host, port = sender.listen(True, 60.0)
    spec = {"group": "tied", "host": host, "port": port, "world": 2, "backend": "gloo", "timeout_s": 60.0,
            "rank_offset": 1}  # fmt: skip
    joined = threading.Thread(target=worker.fa_join, args=(json.dumps(spec),))
    joined.start()
    sender.form("tied", 2, "gloo", 60.0)
    joined.join(timeout=60)
    receiving = threading.Thread(
        target=worker.fa_receive, args=(json.dumps({"group": "tied", "buckets": buckets, "dtype": "float32"}),)
    )
    receiving.start()
    stats = sender.send(buckets, "float32")
    receiving.join(timeout=120)
    sender.close()
    from safetensors.torch import load_file

    ref = {k: v for f in sorted((tmp_path / "ref").glob("model-*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(worker.model_runner.loaded) == sorted(ref) and "lm_head.weight" not in ref
    assert all(torch.equal(worker.model_runner.loaded[k], ref[k]) for k in ref)
    assert worker.fa_loaded_digest()["digest"] == stats["digest"] == recorded_digest(str(tmp_path / "ref"))


def test_lora_sends_the_adapter_alone_and_its_merged_export_is_tied(ray_local, tied_model, tmp_path):
    """The adapter-only sync sends the adapter (on the linear layers: neither the embedding nor the head); the
    merged model (the fallback sync and the HF export of a LoRA run) is the tied layout with the trainer's
    log-probs."""
    from safetensors.torch import load_file

    from fully_async.training import lora

    be = _backend(tied_model, 1, LoraConfig(rank=4, alpha=8))
    try:
        groups = make_groups(2, 2, seed=9)
        be.update(groups)
        be.update(groups)
        reported = be.export_adapter(tmp_path / "adapter")
        adapter = load_file(tmp_path / "adapter" / lora.ADAPTER_WEIGHTS)
        assert adapter and all(lora.is_adapter(name) for name in adapter)
        assert not any("embed_tokens" in name or "lm_head" in name for name in adapter)
        from fully_async.vllm_ext.fa_digest import digest

        assert reported == digest(adapter.items())
        want = be.compute_log_probs(groups)
        be.export_weights(tmp_path / "merged", sync=True)
        _assert_tied_export(tmp_path / "merged", tied_model, groups, want)
    finally:
        be.shutdown()
