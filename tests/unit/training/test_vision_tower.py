"""training/vision_tower.py on the tiny Qwen2-VL itself: which names are the tower, what freezing it leaves to train,
and what a sync with it frozen sends."""

from __future__ import annotations

import pytest
import torch

from fully_async.config import TinyModelConfig
from fully_async.training.vision_tower import freeze, is_tower, without_tower


@pytest.fixture(scope="module")
def vlm():
    """The tiny Qwen2-VL's module as verl's engine builds it (random weights: names are what matters here)."""
    from transformers import Qwen2VLForConditionalGeneration

    from fully_async.models.tiny_vlm import vlm_config

    return Qwen2VLForConditionalGeneration(vlm_config(TinyModelConfig(arch="qwen2_vl"))[0])


@pytest.mark.parametrize(
    ("name", "tower"),
    [
        ("visual.blocks.0.attn.qkv.weight", True),  # checkpoint name
        ("model.visual.merger.mlp.0.weight", True),  # transformers' module name; the merger is the tower's
        ("base_model.model.model.visual.patch_embed.proj.weight", True),  # under PEFT
        ("model.language_model.layers.0.self_attn.q_proj.weight", False),
        ("model.layers.0.mlp.up_proj.weight", False),
        ("lm_head.weight", False),
        ("model.visualizer_head.weight", False),  # a component named otherwise is not the tower
    ],
)
def test_tower_names(name, tower):
    assert is_tower(name) is tower


def test_freezing_leaves_the_language_model_to_train(vlm):
    names = [n for n, _ in vlm.named_parameters()]
    tower = {n for n in names if is_tower(n)}
    assert tower and len(tower) < len(names)
    try:
        assert freeze(vlm) == len(tower)
        trainable = {n for n, p in vlm.named_parameters() if p.requires_grad}
        assert trainable == set(names) - tower
    finally:
        vlm.requires_grad_(True)


def test_a_sync_without_the_tower_sends_every_other_tensor_and_drains_its_source(vlm):
    state = vlm.state_dict()
    seen: list[str] = []

    def source():
        for name, t in state.items():
            seen.append(name)  # a rank's per-tensor gather: every step must run, sent or not
            yield name, t

    sent = [name for name, _ in without_tower(source())]
    assert seen == list(state)
    assert sent == [n for n in state if not is_tower(n)]
    assert not any("visual" in n.split(".") for n in sent)


def test_a_text_model_has_nothing_to_freeze():
    layer = torch.nn.Linear(2, 2)
    assert freeze(layer) == 0 and all(p.requires_grad for p in layer.parameters())


def test_lora_adapts_the_language_model_only(vlm):
    """verl builds its PEFT model from these fields (its FSDP engine's _build_lora_module): no adapter in the tower."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    from fully_async.config import LoraConfig
    from fully_async.training.verl_config import lora_fields

    fields = lora_fields(LoraConfig(rank=4), vision=True)
    assert "exclude_modules" not in lora_fields(LoraConfig(rank=4))  # a text model: nothing to exclude
    peft = get_peft_model(
        vlm,
        PeftLora(
            r=4, lora_alpha=16, target_modules=fields["target_modules"], exclude_modules=fields["exclude_modules"]
        ),
    )
    try:
        adapted = [n for n, _ in peft.named_parameters() if ".lora_A." in n]
        assert adapted and not any(is_tower(n) for n in adapted)
        assert any("q_proj" in n for n in adapted)
    finally:
        peft.unload()  # the module fixture's model without the adapter layers again


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_the_collective_sender_given_the_whole_vlm_sends_no_tower_tensor_when_the_tower_is_frozen(vlm, tmp_path, mode):
    """The exclusion is the sender's own (CollectiveSender(tower_frozen=True), as the verl worker builds it): handed
    every tensor of the tiny Qwen2-VL, tower included, a sync over a real gloo group (the engine worker's receiving
    code in a thread) puts on the wire, loads and proves the language model's tensors only, in both sync modes."""
    from safetensors.torch import save_file

    from fully_async.handles import LocalActor
    from fully_async.sync import ParamSync
    from fully_async.vllm_ext.fa_digest import digest
    from fully_async.weights.collective import CollectiveTransport
    from fully_async.weights.collective_sender import CollectiveSender
    from fully_async.weights.verify import VERIFIED_METRIC
    from tests.unit.weights.test_collective import _ThreadEngines, _Worker

    whole = {n: t.detach().clone().contiguous() for n, t in vlm.state_dict().items() if t.is_floating_point()}
    (tmp_path / "model").mkdir()
    save_file(whole, str(tmp_path / "model" / "model.safetensors"))  # the engine's checkpoint: the plan check's names
    trained = {n: t + 1.0 for n, t in whole.items()}
    language = {n: t for n, t in trained.items() if not is_tower(n)}
    assert language and len(language) < len(trained)

    class WholeModel:  # the trainer's side: every tensor it holds, the sender decides what goes
        def weight_sender(self):
            return CollectiveSender(lambda: iter(trained.items()), tower_frozen=True)

    worker = _Worker(tmp_path / "model")
    handle = LocalActor(_ThreadEngines([worker]))
    transport = CollectiveTransport(handle, WholeModel(), tmp_path / "w", "float32", bucket_mb=0.05,
                                    sync_timeout_s=20)  # fmt: skip
    sync = ParamSync(handle, None, tmp_path / "w", "float32", 20.0, transport=transport, mode=mode)
    try:
        timings = sync.sync(1)
        if mode == "background":
            timings = sync.wait()
        assert list(worker.model_runner.loaded) == list(language)  # over the wire: not one tower tensor
        assert all(torch.equal(worker.model_runner.loaded[n], t) for n, t in language.items())
        sent = transport.last["sender"]
        assert sent["bytes"] == 4 * sum(t.numel() for t in language.values())
        assert sent["digest"] == digest(language.items()) and worker.fa_loaded_digest()["digest"] == sent["digest"]
        assert timings[VERIFIED_METRIC] == 1
    finally:
        sync.close(remove=False)
        handle.close()
