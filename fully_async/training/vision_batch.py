"""The image side of a training batch: verl's multi_modal_inputs and Qwen2-VL's mrope position ids, per row.

Contract: `vision_inputs(trajs, attention_mask, P, vision)` returns (None, None) for a batch without images, whatever
`vision` is (the text path is untouched); otherwise one `{pixel_values, image_grid_thw}` per row with images (None
for a text row) and (B, 4, P + R) position ids laid out like `attention_mask` (left-padded prompts of width P). The
pixels are made here from the trajectories' PNG bytes by the model's own processor, once per distinct image set:
the n samples of a group share their prompt's images, so they share one tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fully_async.multimodal.processor import VisionProcessor
    from fully_async.protocol import Trajectory


def vision_inputs(
    trajs: Sequence[Trajectory], attention_mask: torch.Tensor, prompt_width: int, vision: VisionProcessor | None
) -> tuple[list[dict[str, Any] | None] | None, torch.Tensor | None]:
    if not any(t.images for t in trajs):
        return None, None
    if vision is None:
        raise ValueError(
            "a batch with images needs the model's vision processor: the model is not a vision-language model "
            "(docs/vlm.md)"
        )
    # Text positions on all four rows; rows with images get mrope's positions over their tokens.
    mrope = (attention_mask.cumsum(-1) - 1).clamp(min=0).unsqueeze(1).repeat(1, 4, 1)
    inputs: list[dict[str, Any] | None] = []
    made: dict[tuple[int, ...], dict[str, Any]] = {}
    for i, t in enumerate(trajs):
        if not t.images:
            inputs.append(None)
            continue
        key = tuple(id(png) for png in t.images)
        if key not in made:
            made[key] = vision.pixel_inputs(t.images)
        inputs.append(made[key])
        ids = t.prompt_ids.tolist() + t.response_ids.tolist()
        start = prompt_width - len(t.prompt_ids)
        mrope[i, :, start : start + len(ids)] = vision.position_ids(ids, made[key]["image_grid_thw"])
    return inputs, mrope
