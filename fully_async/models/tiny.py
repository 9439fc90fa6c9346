"""A tiny Hugging Face model and tokenizer built locally (no network), cached by a hash of their settings.

The tokenizer is byte-level with no merges: every UTF-8 byte is one token (ids 0-255), so digits, words, spaces and
newlines of any synthetic task are covered and nothing is ever unknown. Three special tokens follow the bytes:
`<|endoftext|>` (eos and pad), `<|im_start|>` and `<|im_end|>`, with a Qwen-style chat template. The model's
`vocab_size` equals the tokenizer's length exactly, so engines and trainers agree on the logits' width.

Contract: `build_tiny_model(cfg)` returns a directory that both transformers (project venv) and vLLM (engine venv) load;
the same settings give byte-identical weights; concurrent builders never expose a half-written directory (each builds
in a private temporary directory and renames it into place; the loser of the race discards its copy).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from fully_async.config import FullyAsyncConfig, ModelConfig, TinyModelConfig

BUILDER_VERSION = 1
"""Bumped whenever the files written change, so old cache entries are not reused."""

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)
NUM_BYTES = 256
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WRITERS: dict[str, Callable[[TinyModelConfig, Path], None]] = {}
"""Writers of the architectures built elsewhere in this package (qwen2_vl: tiny_vlm.py), by model.tiny.arch; filled
by the package's __init__, which every import of this module runs first."""

DEFAULT_CACHE_DIR = Path("~/.cache/fully_async/models")
# Seeding and initialising use torch's global RNG; threads of one process must not interleave there.
_RNG_LOCK = threading.Lock()


def settings_hash(cfg: TinyModelConfig) -> str:
    """Short, stable hash of everything that determines the built files."""
    fields = dataclasses.asdict(cfg)
    if not fields["tie_word_embeddings"]:  # added later: an untied build keeps the name it had before
        del fields["tie_word_embeddings"]
    payload = json.dumps({"builder": BUILDER_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def build_tokenizer(out_dir: Path, extra_specials: tuple[str, ...] = ()) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir. `extra_specials` follow
    the three special tokens (ids 259 on): the tiny vision-language model's image tokens (models/tiny_vlm.py)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # id == byte value, in the same byte -> character table the ByteLevel pre-tokenizer applies.
    vocab = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    # No regex split and no prefix space: the text maps byte for byte, so decode(encode(s)) == s.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + tuple(extra_specials)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    config = {
        # The generic class loads tokenizer.json as written; model-specific classes (Qwen2Tokenizer) would rebuild
        # their own pipeline in transformers 5.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END, *extra_specials],
        "chat_template": CHAT_TEMPLATE,
        **special,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _bytes_to_unicode() -> list[str]:
    """The GPT-2 byte -> printable character table that the ByteLevel pre-tokenizer uses, indexed by byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(NUM_BYTES + extra)
            extra += 1
    return [table[b] for b in range(NUM_BYTES)]


def text_fields(cfg: TinyModelConfig, vocab_size: int) -> dict:
    """The language model's config fields of a tiny build (any architecture): its sizes, initialisation and the
    end-of-sequence token as bos / eos / pad."""
    eos = NUM_BYTES
    return dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def _model_config(cfg: TinyModelConfig):
    from transformers import LlamaConfig, Qwen2Config

    common = text_fields(cfg, VOCAB_SIZE)
    config = Qwen2Config(**common) if cfg.arch == "qwen2" else LlamaConfig(**common)
    config.dtype = "float32"
    return config, [NUM_BYTES, NUM_BYTES + 2]


def _write_model(cfg: TinyModelConfig, out_dir: Path) -> None:
    import torch

    if cfg.arch in WRITERS:
        WRITERS[cfg.arch](cfg, out_dir)
        return
    if cfg.arch not in ("qwen2", "llama"):
        raise ValueError(f"no writer registered for model.tiny.arch={cfg.arch!r} (fully_async/models/__init__.py)")
    from transformers import AutoModelForCausalLM

    config, eos_ids = _model_config(cfg)
    write_seeded(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32), cfg.seed, eos_ids, out_dir)
    build_tokenizer(out_dir)


def write_seeded(make, seed: int, eos_ids: list[int], out_dir: Path) -> None:
    """The model `make()` builds under `seed` (fork_rng keeps the caller's global RNG untouched; the seed alone
    decides the weights), saved as safetensors with its generation config (engines stop on any of `eos_ids`: a chat
    turn ends with <|im_end|>, plain text with <|endoftext|>)."""
    import torch
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    with _RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would be a fresh machine's first console line
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[0], bos_token_id=eos_ids[0]).save_pretrained(out_dir)


def build_tiny_model(cfg: TinyModelConfig, cache_dir: str | Path | None = None) -> Path:
    """Build (or reuse from the cache) the tiny model described by cfg and return its directory."""
    cfg.validate_section("model.tiny.")
    root = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser().resolve()
    final = root / f"tiny-{cfg.arch}-{settings_hash(cfg)}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _write_model(cfg, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another builder renamed its copy first; identical settings give identical files, so keep theirs.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model_path(model_cfg: ModelConfig) -> Path:
    """model.path when set (an existing model directory with a config.json, a Hugging Face hub id: the local cache
    first, then a download when online; or a GGUF file, converted once under model.cache_dir; fully_async.models.hub),
    else the cached tiny build."""
    if model_cfg.path:
        from fully_async.models.hub import resolve_pretrained

        return resolve_pretrained(model_cfg.path, model_cfg.cache_dir)
    return build_tiny_model(model_cfg.tiny, model_cfg.cache_dir)


def resolve_run_model(cfg: FullyAsyncConfig) -> Path:
    """The model of a run: resolve_model_path with the tiny model's init seed mixed with the run's `seed`."""
    tiny = dataclasses.replace(cfg.model.tiny, seed=cfg.mixed_seed(cfg.model.tiny.seed))
    return resolve_model_path(dataclasses.replace(cfg.model, tiny=tiny))
