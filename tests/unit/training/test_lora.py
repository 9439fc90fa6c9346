"""fully_async/training/lora.py on a real PEFT model in this process (no ranks): the adapter's names are PEFT's own,
the merge is PEFT's merge_and_unload, and a written adapter loads back with PEFT."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fully_async.config import TinyModelConfig
from fully_async.training import lora
from fully_async.vllm_ext import fa_digest


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fully_async.models.tiny import build_tiny_model

    path = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), tmp_path_factory.mktemp("m"))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=12, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    model.fa_path = path
    return model


def test_adapter_names_are_the_ones_peft_saves(peft_model):
    from peft import get_peft_model_state_dict

    want = get_peft_model_state_dict(peft_model)
    got = dict(lora.adapter_tensors(peft_model.state_dict().items()))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_merge_is_peft_merge_and_unload(peft_model):
    import copy

    config = lora.adapter_config(peft_model.peft_config["default"])
    assert lora.scaling(config) == 3.0
    merged = dict(lora.merged_tensors(peft_model.state_dict().items(), lora.scaling(config)))
    want = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(merged[name], want[name], atol=1e-6, rtol=1e-6)
    # in any order (a sender may gather tensors in its own order), and a layer missing its B is an error
    shuffled = list(peft_model.state_dict().items())[::-1]
    assert dict(lora.merged_tensors(shuffled, 3.0)).keys() == want.keys()
    without_b = [(n, t) for n, t in shuffled if "q_proj.lora_B" not in n]
    with pytest.raises(ValueError, match="without weight, A and B"):
        list(lora.merged_tensors(without_b, 3.0))


def test_a_written_adapter_loads_back_with_peft(peft_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = lora.adapter_config(peft_model.peft_config["default"], str(peft_model.fa_path))
    digest = lora.write_adapter(lora.adapter_tensors(peft_model.state_dict().items()), config, tmp_path, "bfloat16")
    written = load_file(tmp_path / lora.ADAPTER_WEIGHTS)
    assert {t.dtype for t in written.values()} == {torch.bfloat16} and digest == fa_digest.digest(written.items())
    assert isinstance(json.loads((tmp_path / lora.ADAPTER_CONFIG).read_text())["target_modules"], list)
    base = AutoModelForCausalLM.from_pretrained(peft_model.fa_path, torch_dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path)
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        got, want = loaded(input_ids=ids).logits, peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids).logits
    err, effect = (got - want).abs().max(), (want - plain).abs().max()
    assert err < 0.02 * effect, (err, effect)  # the adapter, rounded to bfloat16, not the base model
