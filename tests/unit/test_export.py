"""`python -m fully_async.export`: which checkpoint it reads, and the errors for a directory or step that has none
(the export itself runs on real checkpoints in tests/integration/test_verl_backend.py and test_export_resume.py)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from fully_async.export import ExportError, find_checkpoint, main


def _checkpoint(run, step: int, complete: bool = True):
    backend = run / "checkpoints" / f"step_{step}" / "backend"
    backend.mkdir(parents=True)
    if complete:
        (backend / "fully_async_backend.json").write_text(json.dumps({"step": step, "world_size": 2}))
    return backend.parent


def test_the_latest_checkpoint_or_the_step_asked_for(tmp_path):
    first, second = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    (tmp_path / "checkpoints" / "latest").write_text("step_4")
    assert find_checkpoint(tmp_path) == second
    assert find_checkpoint(tmp_path, 2) == first


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("none", [], "is not a run directory with checkpoints"),
        ("steps", ["--step", "3"], r"no checkpoint for step 3 in .*; steps there: \[2, 4\]"),
        ("no_latest", [], r"has no checkpoint \(no 'latest'\); steps there: \[2\]"),
        ("half", ["--step", "2"], r"is not a complete checkpoint \(no backend/fully_async_backend.json\)"),
    ],
)
def test_a_directory_or_step_without_a_checkpoint_is_a_clear_error(tmp_path, capsys, setup, args, message):
    if setup == "steps":
        _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
        (tmp_path / "checkpoints" / "latest").write_text("step_4")
    elif setup == "no_latest":
        _checkpoint(tmp_path, 2)
    elif setup == "half":
        _checkpoint(tmp_path, 2, complete=False)
    with pytest.raises(ExportError, match=message):
        find_checkpoint(tmp_path, int(args[1]) if args else None)
    assert main([str(tmp_path), *args, "--out", str(tmp_path / "out")]) == 2
    assert "fully_async.export: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_weights_are_as_readable_as_the_files_beside_them(tmp_path, umask):
    """safetensors' save_file creates owner-only (0600) files: an hf/ export or a LoRA adapter would be unreadable to
    an engine server of another user on a shared filesystem while the index and configs beside them are readable.
    Both writers give the weights their neighbours' mode, which follows the umask."""
    import torch

    from fully_async.training.hf_files import INDEX, write_safetensors
    from fully_async.training.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_adapter

    old = os.umask(umask)
    try:
        files = write_safetensors([("a.weight", torch.ones(64, 64)), ("b.weight", torch.ones(64))], tmp_path / "hf",
                                  bucket_bytes=1024)  # fmt: skip
        write_adapter([("l.lora_A.weight", torch.ones(2, 4))], {"r": 2}, tmp_path / "adapter")
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    assert len(files) == 2
    for path in [*(tmp_path / "hf" / f for f in files), tmp_path / "hf" / INDEX,
                 tmp_path / "adapter" / ADAPTER_WEIGHTS, tmp_path / "adapter" / ADAPTER_CONFIG]:  # fmt: skip
        assert path.stat().st_mode & 0o777 == want, (path.name, oct(path.stat().st_mode & 0o777))


@pytest.mark.parametrize("model_path", [True, False], ids=["model.path", "tiny"])
def test_a_vision_language_checkpoint_exports_under_its_hf_names_with_the_tower_and_the_processor(tmp_path, model_path):
    """A Qwen2-VL checkpoint (the module's state dict as a 1-rank shard, named as transformers holds it in memory:
    `model.visual.*`, `model.language_model.*`) comes out under the names its Hugging Face checkpoint carries, tower
    included, every tensor as it was, with the processor's files; transformers loads it back to the same weights.
    The files come from model.path, or for a run of the built-in tiny model (model.path null: task=colors) from its
    local build named by the run's model.tiny settings."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2VLForConditionalGeneration

    from fully_async.config import TinyModelConfig
    from fully_async.export import export_checkpoint
    from fully_async.models import build_tiny_model
    from fully_async.training.hf_files import MODEL_FILES
    from fully_async.training.vision_tower import is_tower

    model = build_tiny_model(TinyModelConfig(arch="qwen2_vl"), tmp_path / "models")
    module = Qwen2VLForConditionalGeneration.from_pretrained(model)
    state = {name: t.detach().clone() for name, t in module.state_dict().items()}
    assert any(n.startswith("model.visual.") for n in state) and any(
        n.startswith("model.language_model.") for n in state
    )
    backend = _checkpoint(tmp_path / "run", 3)
    backend = backend / "backend"
    torch.save(state, backend / "model_world_size_1_rank_0.pt")
    tiny = {"path": None, "tiny": dataclasses.asdict(TinyModelConfig(arch="qwen2_vl")), "cache_dir": str(model.parent)}
    config = {"model": {"path": str(model)} if model_path else tiny}
    (backend.parent / "state.json").write_text(json.dumps({"config": config}))

    out = tmp_path / "export"
    export_checkpoint(backend.parent, out, progress=None)
    exported = {n: t for f in out.glob("model-*.safetensors") for n, t in load_file(f).items()}
    built = load_file(next(model.glob("*.safetensors")))
    assert set(exported) == set(built)  # the checkpoint's names: visual.*, model.*, lm_head.weight
    assert any(is_tower(n) for n in exported)
    for name in ("preprocessor_config.json", "processor_config.json", "tokenizer.json"):
        assert name in MODEL_FILES and (out / name).read_bytes() == (model / name).read_bytes(), name
    back = Qwen2VLForConditionalGeneration.from_pretrained(out).state_dict()
    assert back.keys() == state.keys() and all(torch.equal(back[n], state[n]) for n in state)


@pytest.mark.parametrize(
    ("name", "model_type", "checkpoint"),
    [
        ("model.visual.blocks.0.attn.qkv.weight", "qwen2_vl", "visual.blocks.0.attn.qkv.weight"),
        ("model.language_model.layers.0.mlp.up_proj.weight", "qwen2_5_vl", "model.layers.0.mlp.up_proj.weight"),
        ("lm_head.weight", "qwen2_vl", "lm_head.weight"),
        ("model.layers.0.mlp.up_proj.weight", "qwen2", "model.layers.0.mlp.up_proj.weight"),  # a text model
        ("model.language_model.layers.0.mlp.up_proj.weight", None, "model.language_model.layers.0.mlp.up_proj.weight"),
    ],
)
def test_checkpoint_names_rename_only_the_layouts_transformers_renames(name, model_type, checkpoint):
    from fully_async.training.hf_names import checkpoint_name

    assert checkpoint_name(name, model_type) == checkpoint


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_a_tied_model_exports_without_its_head_and_loads_back_tied_to_the_trained_embedding(tmp_path, lora_rank):
    """Issue 48: a model that ties its word embeddings (SmolLM2) comes out as save_pretrained writes it: the
    embedding once, no lm_head.weight (vLLM's loader skips a tied head; training/hf_files.without_tied_head), the
    recorded digest that of the files, and transformers loads it tied to the trained embedding. The checkpoint holds
    the module's state dict, head included (torch's state_dict lists a shared parameter under both names); a LoRA
    run's holds PEFT's names and comes out merged (the adapter, on the linear layers, touches neither)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fully_async.config import TinyModelConfig
    from fully_async.export import export_checkpoint
    from fully_async.models import build_tiny_model
    from fully_async.training import lora
    from fully_async.vllm_ext.fa_digest import directory_digest, recorded_digest

    model_dir = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                                 intermediate_size=64, tie_word_embeddings=True), tmp_path / "m")  # fmt: skip
    module = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        module.model.embed_tokens.weight.add_(1.0)  # trained: the export must carry the new embedding
    backend = _checkpoint(tmp_path / "run", 3) / "backend"
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        module = get_peft_model(module, LoraConfig(r=lora_rank, lora_alpha=8, target_modules="all-linear"))
        (backend.parent / "adapter").mkdir()
        adapter_config = {"r": lora_rank, "lora_alpha": 8}
        (backend.parent / "adapter" / lora.ADAPTER_CONFIG).write_text(json.dumps(adapter_config))
    state = {name: t.detach().clone() for name, t in module.state_dict().items()}
    assert any(n.endswith("lm_head.weight") for n in state)  # the checkpoint has the head
    torch.save(state, backend / "model_world_size_1_rank_0.pt")
    (backend.parent / "state.json").write_text(json.dumps({"config": {"model": {"path": str(model_dir)}}}))

    out = tmp_path / "export"
    export_checkpoint(backend.parent, out, progress=None)
    exported = {n: t for f in out.glob("model-*.safetensors") for n, t in load_file(f).items()}
    assert set(exported) == set(load_file(model_dir / "model.safetensors"))  # the tied layout: no lm_head.weight
    assert recorded_digest(str(out)) == directory_digest(str(out))[0]
    back = AutoModelForCausalLM.from_pretrained(out)
    trained = state[("base_model.model." if lora_rank else "") + "model.embed_tokens.weight"]
    assert torch.equal(back.model.embed_tokens.weight, trained)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
