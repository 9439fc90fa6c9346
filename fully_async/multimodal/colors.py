"""The built-in visual task `task=colors`: a small image of one flat color, answered by the color's letter.

The prompt is `<image>color? r g b y` and the answer one of those letters (one token of the byte-level tokenizer, so
the task is learnable from random init like `copy`: the answer is a lookup of the image's mean color). Graded by the
built-in rule (reward/rule.py: the response opens with the answer). The images are drawn on the fly from the row's
seed, with a little noise per 7x7 block so no two prompts are the same picture.
"""

from __future__ import annotations

import random

from fully_async.multimodal.images import IMAGE_PLACEHOLDER, to_png

COLORS = {"r": (220, 30, 30), "g": (30, 200, 40), "b": (30, 40, 220), "y": (230, 220, 30)}
"""Letter -> RGB of the task's colors."""
SIZE = 56
"""Side of the images in pixels: 16 patches, 4 image tokens for the tiny Qwen2-VL."""
PROMPT = f"{IMAGE_PLACEHOLDER}color? {' '.join(COLORS)}"
NOISE = 20
"""Jitter of each channel, +-NOISE, per block of SIZE / BLOCKS pixels."""
BLOCKS = 8


def color_image(letter: str, rng: random.Random) -> bytes:
    """A SIZE x SIZE PNG of the letter's color with block noise drawn from rng."""
    import numpy as np
    from PIL import Image

    # Noise per 7x7 block, not per pixel: each patch still differs, and the PNG stays a few hundred bytes.
    noise = np.random.default_rng(rng.getrandbits(64)).integers(-NOISE, NOISE + 1, (BLOCKS, BLOCKS, 3))
    pixels = np.clip(np.array(COLORS[letter]) + noise, 0, 255).astype(np.uint8)
    return to_png(Image.fromarray(pixels, "RGB").resize((SIZE, SIZE), Image.Resampling.NEAREST))


def color_row(rng: random.Random) -> tuple[str, str, list[bytes]]:
    """(prompt text, answer, images) of one row."""
    letter = rng.choice(sorted(COLORS))
    return PROMPT, letter, [color_image(letter, rng)]
