"""Token-exact multi-turn machinery: tool turns as template differences on Qwen2.5-style, Qwen3-style and the tiny
model's templates (tokenizers built here, templates written here: no downloads), and the Transcript's arrays."""

from __future__ import annotations

import numpy as np
import pytest

from fully_async.agents.tokens import ChatDelta, TemplateError, Transcript
from fully_async.models.tiny import _bytes_to_unicode, build_tokenizer
from fully_async.protocol import NO_VERSION, PromptRef

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen's tool and think markers are added tokens that are not special (they survive skip_special_tokens).
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# A Qwen2.5-Instruct-style template (written for this test): a default system prompt, tools in the system turn,
# assistant tool calls as <tool_call> blocks, consecutive tool messages grouped in one user turn.
QWEN25 = (
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}"
    "{%- else %}{%- set sys = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + sys }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>' }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) or (m.role == 'assistant' and not m.tool_calls) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    '{%- for tc in m.tool_calls %}{{- \'\\n<tool_call>\\n{"name": "\' + tc.name + \'", "arguments": \' '
    "+ (tc.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A Qwen3-style template (written for this test): assistant turns after the last real user query keep a <think>
# block only when last or when they have reasoning, earlier ones lose it; enable_thinking=false pre-fills an empty
# think block in the generation prompt. Re-rendering a chat under it rewrites earlier turns.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=messages|length - 1, done=false) %}"
    "{%- for m in messages[::-1] %}{%- set i = messages|length - 1 - loop.index0 %}"
    "{%- if not ns.done and m.role == 'user' %}{%- set ns.last_query = i %}{%- set ns.done = true %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def qwen_like_tokenizer(template: str, merges: bool = True):
    """Byte-level BPE with one merge ("\\n\\n" is one token, as in real BPE vocabularies, so token seams matter),
    Qwen's special tokens and tool/think markers, and the given chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    vocab = {ch: b for b, ch in enumerate(table)}
    merge_list = []
    if merges:
        nl = table[ord("\n")]
        vocab[nl + nl] = len(vocab)
        merge_list = [(nl, nl)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merge_list, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=SPECIAL[1:]
    )
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


TOOLS = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "x\n\ny"}]


def test_qwen25_tool_turn_is_the_template_difference():
    tok = qwen_like_tokenizer(QWEN25)
    chat = ChatDelta(tok)
    want = (
        "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nx\n\ny\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.delta(TOOLS) == enc(tok, want)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.end_of_turn_id == im_end
    assert chat.boundary(im_end) == enc(tok, "\n")  # the newline the model never generates
    assert chat.boundary(enc(tok, "a")[0]) == [im_end, *enc(tok, "\n")]  # a turn cut short is closed first


def test_qwen25_token_list_equals_the_full_render():
    """The exact list (prompt, model turn, boundary, delta) reads as the template renders the whole chat: the
    difference method loses nothing and adds nothing for an append-only template."""
    tok = qwen_like_tokenizer(QWEN25)
    chat = ChatDelta(tok)
    messages = [{"role": "user", "content": "What is 6*7?"}]
    model_text = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = chat.render_ids(messages, add_generation_prompt=True) + enc(tok, model_text) + [im_end]
    ids += chat.boundary(im_end) + chat.delta(TOOLS[:1])
    full = messages + [{"role": "assistant", "content": model_text}, TOOLS[0]]
    assert tok.decode(ids) == chat.render_text(full, add_generation_prompt=True)


def test_qwen3_delta_holds_while_a_full_re_render_rewrites_the_model_turn():
    tok = qwen_like_tokenizer(QWEN3)
    chat = ChatDelta(tok, {"enable_thinking": False})
    want = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert chat.delta(TOOLS[:1]) == enc(tok, want)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.boundary(im_end) == enc(tok, "\n")
    messages = [{"role": "user", "content": "Hi"}]
    prompt = chat.render_ids(messages, add_generation_prompt=True)
    model = enc(tok, "call it") + [im_end]
    exact = prompt + model + chat.boundary(im_end) + chat.delta(TOOLS[:1])
    assert tok.decode(exact).startswith(tok.decode(prompt + model))  # what the engine saw stays as it was
    # Why the whole chat is never re-rendered: under this template the earlier turn loses its think block.
    rerender = chat.render_text(messages + [{"role": "assistant", "content": "call it"}, TOOLS[0]], True)
    assert rerender != tok.decode(exact)


def test_tiny_model_template(tiny_tokenizer):
    tok = tiny_tokenizer
    chat = ChatDelta(tok)
    assert chat.delta(TOOLS[:1]) == enc(tok, "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.end_of_turn_id == im_end and chat.boundary(im_end) == enc(tok, "\n")
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert chat.boundary(eos) == [im_end, *enc(tok, "\n")]  # stopped on eos: the template's <|im_end|> is inserted


def test_a_merge_across_the_seam_falls_back_to_the_text_difference():
    # The tool turn starts with a newline right after the prefix's final newline: "\n\n" merges into one token in
    # the full render, so the prefix's ids are not a prefix of the full ids; the text still is.
    template = (
        "{%- for m in messages %}{%- if m.role == 'tool' %}{{- '\\n[tool] ' + m.content + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    )
    tok = qwen_like_tokenizer(template)
    chat = ChatDelta(tok)
    full = chat.render_ids([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, TOOLS[0]], False)
    assert full[: len(chat._prefix_ids)] != chat._prefix_ids  # the seam really merged
    assert chat.delta(TOOLS[:1], add_generation_prompt=False) == enc(tok, "\n[tool] 42<|im_end|>\n")


def test_a_template_that_refuses_a_system_turn_gets_a_user_only_prefix():
    from fully_async.models.tiny import CHAT_TEMPLATE

    tok = qwen_like_tokenizer(
        "{%- if messages[0].role == 'system' %}{{- raise_exception('System role not supported') }}{%- endif %}"
        + CHAT_TEMPLATE
    )
    chat = ChatDelta(tok)
    assert [m["role"] for m in chat.prefix] == ["user"]
    assert chat.delta(TOOLS[:1]) == enc(tok, "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_rewrites_the_prefix_is_refused():
    tok = qwen_like_tokenizer("{{- messages|length }}" + QWEN25)
    with pytest.raises(TemplateError, match="not append-only"):
        ChatDelta(tok).delta(TOOLS[:1])


def test_transcript_arrays():
    tr = Transcript([1, 2, 3])
    tr.add_model([10, 11], [-0.5, -0.25], [0, 0])
    tr.add_inserted([20, 21, 22])
    tr.add_model([12], [-1.0], [1])
    assert tr.ids == [1, 2, 3, 10, 11, 20, 21, 22, 12] and len(tr) == 6 and tr.last_token == 12
    t = tr.to_trajectory(prompt=PromptRef(0, 7), sample_index=1, start_version=0)
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert t.token_versions.tolist() == [0, 0, NO_VERSION, NO_VERSION, NO_VERSION, 1]
    assert np.allclose(t.behaviour_logprobs, [-0.5, -0.25, 0, 0, 0, -1.0])
    assert (t.min_version, t.max_version) == (0, 1)  # inserted tokens do not count for staleness
    with pytest.raises(ValueError, match="2 tokens, 1 log-probs"):
        tr.add_model([1, 2], [-1.0], [0, 0])


def test_transcript_carries_kv_cache_versions_older_than_the_tokens():
    """on_sync=keep: a turn whose request outlived a sync has tokens of version 2 over a cache written at 1; a
    trajectory carries cache_versions only when some differ from the tokens' own."""
    tr = Transcript([1, 2])
    tr.add_model([10, 11, 12], [-0.5] * 3, [1, 2, 2], [1, 1, 1])
    tr.add_inserted([20])
    tr.add_model([13], [-1.0], [2], None)  # a later turn sent at 2: its cache is its own version
    t = tr.to_trajectory(prompt=PromptRef(0, 7), sample_index=0, start_version=1)
    assert t.cache_versions.tolist() == [1, 1, 1, NO_VERSION, 2] and t.token_versions.tolist() == [1, 2, 2, -1, 2]
    same = Transcript([1])
    same.add_model([10], [-0.5], [3], [3])
    assert same.to_trajectory(prompt=PromptRef(0, 8), sample_index=0).cache_versions is None
    with pytest.raises(ValueError, match="2 cache versions"):
        tr.add_model([1], [-1.0], [0], [0, 0])
