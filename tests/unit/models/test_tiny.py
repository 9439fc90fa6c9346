"""The locally built tiny model: loads with transformers, tokenizer round-trips, cache and atomic build."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import pre_tokenizers

from fully_async.config import ConfigError, ModelConfig, TinyModelConfig
from fully_async.models import build_tiny_model, resolve_model_path, tiny

SMALL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tiny_model(SMALL, tmp_path_factory.mktemp("models"))


def test_byte_table_matches_the_byte_level_alphabet():
    table = tiny._bytes_to_unicode()
    assert len(set(table)) == tiny.NUM_BYTES
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())


def test_tokenizer_round_trips_task_text_and_vocab_equals_model(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert len(tok) == model.config.vocab_size == tiny.VOCAB_SIZE
    assert model.dtype == torch.float32
    text = "What is 12 + 345?\nAnswer: 357. The quick brown fox, ok! (a-b)*c = {x}"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert tok.eos_token == tok.pad_token == tiny.EOS_TOKEN
    for special in tiny.SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(special) >= tiny.NUM_BYTES
    out = model(torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), tiny.VOCAB_SIZE)


def test_chat_template_is_qwen_style(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    text = tok.apply_chat_template([{"role": "user", "content": "1+1"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids(tiny.IM_START)
    assert tiny.NUM_BYTES + 2 in ids  # <|im_end|> is one token, not its characters


def test_generation_config_stops_on_both_end_tokens(built):
    gen = json.loads((built / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == [tiny.NUM_BYTES, tiny.NUM_BYTES + 2]


def test_same_settings_reuse_cache_and_seed_decides_weights(tmp_path, built):
    again = build_tiny_model(SMALL, built.parent)
    assert again == built
    other = build_tiny_model(dataclasses.replace(SMALL, seed=1), built.parent)
    assert other != built
    fresh = build_tiny_model(SMALL, tmp_path)  # rebuilt from scratch elsewhere: identical weights
    a, b, c = (load_file(p / "model.safetensors") for p in (built, fresh, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())


def test_llama_arch(tmp_path):
    from transformers import AutoConfig

    path = build_tiny_model(dataclasses.replace(SMALL, arch="llama"), tmp_path)
    assert AutoConfig.from_pretrained(path).model_type == "llama"


def test_concurrent_builders_leave_one_complete_directory(tmp_path):
    results, errors = [], []

    def build():
        try:
            results.append(build_tiny_model(SMALL, tmp_path))
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temporary directories left behind
    assert (results[0] / "model.safetensors").is_file()


def test_invalid_settings_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model.tiny.hidden_size"):
        build_tiny_model(dataclasses.replace(SMALL, hidden_size=33), tmp_path)


def test_resolve_model_path(tmp_path, built):
    assert resolve_model_path(ModelConfig(path=str(built))) == built
    assert resolve_model_path(ModelConfig(tiny=SMALL, cache_dir=str(built.parent))) == built
    with pytest.raises(ConfigError, match="model.path.*not found"):
        resolve_model_path(ModelConfig(path=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model_path(ModelConfig(path=str(tmp_path)))


def test_run_seed_reaches_the_tiny_model_and_the_shuffle(built):
    from fully_async.config import compose
    from fully_async.data import EpochCursor
    from fully_async.models import resolve_run_model

    zero, one, two = (compose([f"seed={s}", "model.tiny.seed=0", "data.seed=0"]) for s in (0, 1, 2))
    for cfg in (zero, one, two):
        cfg.model = ModelConfig(tiny=SMALL, cache_dir=str(built.parent))
    assert zero.mixed_seed(0) == 0 and zero.mixed_seed(7) == 7  # seed=0: the section seeds as they are
    assert len({one.mixed_seed(0), two.mixed_seed(0), one.mixed_seed(7)}) == 3
    paths = {resolve_run_model(cfg) for cfg in (zero, one, two)}
    assert len(paths) == 3 and resolve_run_model(zero) == built
    orders = {tuple(EpochCursor(64, cfg.mixed_seed(cfg.data.seed))._permutation(0)) for cfg in (zero, one, two)}
    assert len(orders) == 3


def test_a_tied_build_shares_the_head_with_the_embedding_and_untied_builds_keep_their_cache_names(tmp_path):
    """model.tiny.tie_word_embeddings=true (issue 48: SmolLM2 ties its embeddings): the head is the embedding in
    transformers, and the files hold the embedding once, as save_pretrained writes a tied model. The field was
    added later: a default build keeps the cache name it had (5f12fcc... is the default's name before the field)."""
    from transformers import AutoModelForCausalLM

    assert tiny.settings_hash(TinyModelConfig()) == "5f12fccafb555c29"
    tied = dataclasses.replace(SMALL, tie_word_embeddings=True)
    assert tiny.settings_hash(tied) != tiny.settings_hash(SMALL)
    path = build_tiny_model(tied, tmp_path)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    files = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in files and "model.embed_tokens.weight" in files
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ConfigError, match="model.tiny.tie_word_embeddings"):
        build_tiny_model(dataclasses.replace(tied, arch="qwen2_vl"), tmp_path)
