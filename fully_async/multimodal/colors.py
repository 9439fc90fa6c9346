"""The built-in visual task `task=colors`: a small image of one flat color, answered by the color's letter.

The prompt is `<image>color? r g b y` and the answer one of those letters (one token of the byte-level tokenizer, so
the task is learnable from random init like `copy`: the answer is a lookup of the image's mean color). Graded by the
built-in rule (reward/rule.py: the response opens with the answer). The images are drawn on the fly from the row's
seed, with a little noise per pixel so no two prompts are the same picture.
"""

from __future__ import annotations

import random

from fully_async.multimodal.images import IMAGE_PLACEHOLDER, _png

COLORS = {"r": (220, 30, 30), "g": (30, 200, 40), "b": (30, 40, 220), "y": (230, 220, 30)}
"""Letter -> RGB of the task's colors."""
SIZE = 56
"""Side of the images in pixels: 16 patches, 4 image tokens for the tiny Qwen2-VL."""
PROMPT = f"{IMAGE_PLACEHOLDER}color? {' '.join(COLORS)}"
NOISE = 20
"""Per-pixel jitter of each channel, +-NOISE."""


def color_image(letter: str, rng: random.Random) -> bytes:
    """A SIZE x SIZE PNG of the letter's color with per-pixel noise drawn from rng."""
    from PIL import Image

    base = COLORS[letter]
    pixels = bytes(
        max(0, min(255, c + rng.randint(-NOISE, NOISE))) for _ in range(SIZE * SIZE) for c in base
    )
    return _png(Image.frombytes("RGB", (SIZE, SIZE), pixels))


def color_row(rng: random.Random) -> tuple[str, str, list[bytes]]:
    """(prompt text, answer, images) of one row."""
    letter = rng.choice(sorted(COLORS))
    return PROMPT, letter, [color_image(letter, rng)]
