"""Tool turns that show the model an image (a vision-language model, docs/vlm.md "A tool that returns an image").

A tool's result may carry images (`ToolResult.images`, PNG bytes). Its tool message then holds one image token per
image (`<|vision_start|><|image_pad|><|vision_end|>`, before the tool's text), and the turn is kept in two views:
- the short one, one image token per image, is what the engine is sent (with every image of the episode so far, in
  order): the engine expands each image token to the image's patch count itself;
- the expanded one, each image token repeated as the engine lays it out, is what the Trajectory stores and the
  trainer scores (mask 0, NO_VERSION: inserted tokens are never trained on).
The images are appended to the episode's image list in the order their tokens appear, which is the order both the
engine and the trainer's processor pair image tokens with images.

Contract: `check_vision_model(...)` raises a VisionError when a tool returns images to a text model;
`tool_content(vision, text, n)` is the tool message's content for a result with `n` images;
`expand_turn(vision, ids, images)` is the expanded view of an inserted turn whose short view is `ids` (a
VisionError when its image tokens and `images` disagree, e.g. a tool's text that spells a vision token itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fully_async.multimodal.processor import VisionError

if TYPE_CHECKING:
    from fully_async.multimodal.processor import VisionProcessor


def check_vision_model(serves_vision: bool, tool: str, tokenizer: Any) -> None:
    """A tool's images need a vision-language model: a VisionError naming the tool and the model otherwise (the
    sample fails with it; a text model would read the image tokens as text)."""
    if not serves_vision:
        raise VisionError(
            f"tool {tool!r} returned images but the model ({getattr(tokenizer, 'name_or_path', '?')}) is not a "
            "vision-language model (docs/vlm.md)"
        )


def tool_content(vision: VisionProcessor, text: str, n_images: int) -> str:
    """The tool message's content: the images' tokens first, then the tool's text."""
    return vision.vision_text * n_images + text


def expand_turn(vision: VisionProcessor, ids: Sequence[int], images: Sequence[bytes]) -> list[int]:
    """The trainer's view of an inserted turn: each of its image tokens expanded to its image's patch tokens."""
    if not images:
        if vision.image_token_id in ids:  # a tool's text that spells the image token: no image to pair it with
            return vision.expand(ids, images)  # raises VisionError naming the count
        return list(ids)
    return vision.expand(ids, images)
