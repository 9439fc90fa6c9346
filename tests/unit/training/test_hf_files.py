"""training/hf_files.without_tied_head: what every weight path sends for a model that ties its word embeddings."""

from __future__ import annotations

import pytest
import torch

from fully_async.training.hf_files import ties_embeddings, without_tied_head


def _tensors(head_equal: bool = True):
    embed = torch.randn(8, 4)
    head = embed.clone() if head_equal else embed + 1
    return [("model.embed_tokens.weight", embed), ("model.norm.weight", torch.ones(4)), ("lm_head.weight", head)]


def test_a_tied_model_sends_the_embedding_once_and_an_untied_one_everything():
    assert [n for n, _ in without_tied_head(_tensors(), tied=True)] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]
    assert [n for n, _ in without_tied_head(_tensors(head_equal=False), tied=False)] == [n for n, _ in _tensors()]


def test_a_head_that_no_longer_equals_the_embedding_it_is_tied_to_is_refused_not_dropped():
    with pytest.raises(ValueError, match="lm_head.weight differs from the embedding"):
        list(without_tied_head(_tensors(head_equal=False), tied=True))


def test_tying_is_read_as_transformers_resolves_it_for_the_architecture(tmp_path):
    from transformers import LlamaConfig, Qwen2Config, Qwen2VLConfig

    assert ties_embeddings(Qwen2Config(tie_word_embeddings=True))
    assert not ties_embeddings(LlamaConfig())
    Qwen2Config(tie_word_embeddings=True).save_pretrained(tmp_path)
    assert ties_embeddings(tmp_path)
    assert not ties_embeddings(Qwen2VLConfig(tie_word_embeddings=False))
