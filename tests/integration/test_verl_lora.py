"""LoRA on the verl backend with real Ray ranks on CPU (gloo, two ranks: every tensor leaves sharded): only the
adapter trains, the optimizer holds only the adapter, the exported adapter loads with PEFT and reproduces the
trainer's log-probs, the merged export equals PEFT's own merge, checkpoints restore the adapter, and the export CLI
gives both the adapter and the merged model. One backend serves the module; each test starts from its initial
checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fully_async.config import AlgorithmConfig, LoraConfig, TinyModelConfig, TrainerConfig
from fully_async.training import hf_files, lora
from fully_async.vllm_ext import fa_digest
from tests.helpers import SIM_ROLLOUT
from tests.training_data import hf_log_probs, load_hf_model, make_groups

TEMPERATURE = 0.9
RANK, ALPHA, DROPOUT = 4, 8, 0.05

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fully_async.models.tiny import build_tiny_model

    return build_tiny_model(
        TinyModelConfig(hidden_size=64, intermediate_size=128), cache_dir=tmp_path_factory.mktemp("m")
    )


def _lora_backend(model, ranks: int):
    from fully_async.training import build_backend

    trainer = TrainerConfig(n_gpus_per_node=ranks, max_token_len_per_gpu=512, total_steps=20, lr=1e-2)
    return build_backend(
        trainer, AlgorithmConfig(), model, temperature=TEMPERATURE, device="cpu",
        lora=LoraConfig(rank=RANK, alpha=ALPHA),  # no dropout: updates at two world sizes are compared
    )  # fmt: skip


@pytest.fixture(scope="module")
def be(ray_local, tiny_model, tmp_path_factory):
    backend = _lora_backend(tiny_model, 2)
    backend.fa_init = tmp_path_factory.mktemp("init")
    backend.save_checkpoint(backend.fa_init, 0)
    yield backend
    backend.shutdown()


def _reset(be):
    be.load_checkpoint(be.fa_init)


def _state(be, path):
    """The policy's full module state dict (PEFT names), read back from a checkpoint of it."""
    be.save_checkpoint(path, be.step)
    return hf_files.merged_model(path)


def _weights(out):
    tensors = {}
    for f in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _train(be, steps=3, seed=7):
    for k in range(steps):
        be.update(make_groups(3, 3, seed=seed + k))


def test_updates_train_only_the_adapter_and_the_optimizer_holds_only_it(be, tmp_path):
    _reset(be)
    before = _state(be, tmp_path / "before")
    adapter = [name for name in before if lora.is_adapter(name)]
    assert len(adapter) == 2 * 7 * TinyModelConfig().num_layers  # A and B of q, k, v, o, gate, up, down per layer
    _train(be)
    after = _state(be, tmp_path / "after")
    assert before.keys() == after.keys()
    for name in before:
        same = torch.equal(before[name], after[name])
        assert same != lora.is_adapter(name), f"{name}: {'unchanged' if same else 'changed'}"
    optim = hf_files.merged_optimizer(tmp_path / "after")
    trainable = [after[name] for name in adapter]  # module.parameters() order = state-dict order here
    (group,) = optim["param_groups"]
    assert len(group["params"]) == len(trainable)
    assert sorted(optim["state"]) == list(range(len(trainable)))
    for idx, entry in optim["state"].items():
        assert entry["exp_avg"].shape == trainable[idx].shape and entry["exp_avg"].abs().sum() > 0


def test_the_exported_adapter_loads_with_peft_and_gives_the_trainers_log_probs(be, tiny_model, tmp_path):
    from peft import PeftModel

    _reset(be)
    _train(be)
    groups = make_groups(2, 2, seed=3)
    want = be.compute_log_probs(groups)
    digest = be.export_adapter(tmp_path / "adapter")
    written = load_file(tmp_path / "adapter" / lora.ADAPTER_WEIGHTS)
    assert digest == fa_digest.digest(written.items())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in written
    config = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    model = PeftModel.from_pretrained(load_hf_model(tiny_model), tmp_path / "adapter")
    base = hf_log_probs(load_hf_model(tiny_model), groups, TEMPERATURE)
    for got, lp, lp_base in zip(hf_log_probs(model, groups, TEMPERATURE), want, base, strict=True):
        np.testing.assert_allclose(got, lp, atol=1e-5)
        assert np.abs(lp - lp_base).max() > 1e-3  # the adapter is trained: not the base model's log-probs


def test_exported_weights_are_the_merged_model_peft_would_make(be, tiny_model, tmp_path):
    from peft import PeftModel

    _reset(be)
    _train(be)
    be.export_adapter(tmp_path / "adapter")
    be.export_weights(tmp_path / "merged")
    merged = _weights(tmp_path / "merged")
    want = PeftModel.from_pretrained(load_hf_model(tiny_model), tmp_path / "adapter").merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    base = load_hf_model(tiny_model).state_dict()
    changed = 0
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        changed += not torch.equal(tensor, base[name])
    assert changed == 7 * TinyModelConfig().num_layers  # every adapted layer and nothing else
    # the collective transport's sender walks the same merged tensors (names and shapes in its send plan)
    assert {name: shape for name, shape in be.weight_sender().plan()} == {k: list(t.shape) for k, t in merged.items()}
    groups = make_groups(2, 2, seed=4)
    for got, lp in zip(hf_log_probs(load_hf_model(tmp_path / "merged"), groups, TEMPERATURE),
                       be.compute_log_probs(groups), strict=True):  # fmt: skip
        np.testing.assert_allclose(got, lp, atol=1e-5)


def test_a_checkpoint_restores_the_adapter_exactly(be, tmp_path):
    _reset(be)
    _train(be, steps=2)
    be.save_checkpoint(tmp_path / "ck", be.step)
    saved = be.export_adapter(tmp_path / "a1")
    _train(be, steps=2, seed=20)
    assert be.export_adapter(tmp_path / "a2") != saved
    assert be.load_checkpoint(tmp_path / "ck") == 2
    assert be.export_adapter(tmp_path / "a3") == saved
    a1, a3 = load_file(tmp_path / "a1" / lora.ADAPTER_WEIGHTS), load_file(tmp_path / "a3" / lora.ADAPTER_WEIGHTS)
    assert all(torch.equal(a1[k], a3[k]) for k in a1)


def test_a_lora_checkpoint_resumes_at_another_world_size(be, tiny_model, tmp_path):
    """2 ranks write, 1 rank loads (adapter and its Adam moments joined from the shards): the next update is the one
    the writer makes. A fresh optimizer would move the adapter by ~lr, not ~1e-5."""
    _reset(be)
    _train(be, steps=2)
    be.save_checkpoint(tmp_path / "ck", be.step)
    one = _lora_backend(tiny_model, 1)
    try:
        assert one.load_checkpoint(tmp_path / "ck") == 2
        assert one.export_adapter(tmp_path / "one") == be.export_adapter(tmp_path / "two")
        groups = make_groups(3, 3, seed=40)
        m1, m2 = one.update(groups), be.update(groups)
        assert m1["actor/loss"] == pytest.approx(m2["actor/loss"], rel=1e-5, abs=1e-7)
        one.export_adapter(tmp_path / "one")
        be.export_adapter(tmp_path / "two")
        a1 = load_file(tmp_path / "one" / lora.ADAPTER_WEIGHTS)
        a2 = load_file(tmp_path / "two" / lora.ADAPTER_WEIGHTS)
        for name in a2:
            torch.testing.assert_close(a1[name], a2[name], atol=2e-4, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        one.shutdown()


def test_the_export_cli_writes_the_merged_model_and_the_adapter_of_a_lora_run(be, tiny_model, tmp_path):
    _reset(be)
    _train(be)
    step = tmp_path / "run" / "checkpoints" / "step_3"
    be.save_checkpoint(step / "backend", 3)
    be.export_adapter(step / "adapter")
    (step / "state.json").write_text(json.dumps({"config": {"model": {"path": str(tiny_model)}}}))
    (step.parent / "latest").write_text("step_3")
    be.export_weights(tmp_path / "live")
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "fully_async.export", str(tmp_path / "run"), "--out", str(out)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA" in done.stdout
    exported, live = _weights(out), _weights(tmp_path / "live")
    assert exported.keys() == live.keys()
    assert all(torch.equal(exported[k], live[k]) for k in live)
    a_ckpt = load_file(step / "adapter" / lora.ADAPTER_WEIGHTS)
    a_out = load_file(out / "adapter" / lora.ADAPTER_WEIGHTS)
    assert a_ckpt.keys() == a_out.keys() and all(torch.equal(a_ckpt[k], a_out[k]) for k in a_ckpt)
    assert json.loads((out / "adapter" / lora.ADAPTER_CONFIG).read_text())["r"] == RANK


def test_a_lora_run_checkpoints_the_adapter_and_ends_with_the_merged_model(ray_local, tmp_path):
    """The job hands model.lora to the backend: a short run (simulated engine, the real verl trainer) writes
    step_N/adapter/ (PEFT) and step_N/hf/ (merged), and the one is the other merged onto the base."""
    from peft import PeftModel

    from fully_async.config import compose
    from fully_async.models import resolve_model_path
    from fully_async.simulation import run_schedule

    cfg = compose([*SIM_ROLLOUT, "trainer=verl", f"model.lora.rank={RANK}", f"model.lora.dropout={DROPOUT}",
                   "engine.num_servers=1", "async_training.groups_per_step=2", "trainer.total_steps=2",
                   "trainer.save_every=2", "trainer.lr=1e-2", "model.tiny.hidden_size=64",
                   "model.tiny.intermediate_size=128"])  # fmt: skip
    base = resolve_model_path(cfg.model)
    run_schedule(cfg, tmp_path, str(base))
    step = tmp_path / "checkpoints" / "step_2"
    config = json.loads((step / "adapter" / lora.ADAPTER_CONFIG).read_text())
    # dropout reaches the ranks' PEFT config (verl builds its own without one)
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (RANK, cfg.model.lora.alpha, DROPOUT)
    merged = PeftModel.from_pretrained(load_hf_model(base), step / "adapter").merge_and_unload().state_dict()
    served = _weights(step / "hf")
    assert served.keys() == merged.keys()
    for name, tensor in served.items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    untrained = load_hf_model(base).state_dict()
    assert sum(not torch.equal(served[k], untrained[k]) for k in served) == 7 * cfg.model.tiny.num_layers  # trained
