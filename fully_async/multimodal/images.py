"""Images of a prompt as PNG bytes: what a dataset row, a Trajectory and a request to an engine carry.

Contract: `to_png(x)` accepts what verl's multimodal rows hold in their `images` column (a dict with `bytes` and/or
`path`, a path string, raw PNG/JPEG bytes, a PIL image) and returns PNG bytes; the same picture always gives the
same bytes. Nothing here unpickles or fetches from the network: a path is read from the local disk only.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a prompt's text (verl's layout: one `<image>` per entry of the row's `images`)."""


class ImageError(ValueError):
    """An image of a row cannot be read; the message names what was given."""


def to_png(value: Any, base_dir: Path | None = None) -> bytes:
    """One image of a row as PNG bytes."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return _png(value)
    if isinstance(value, dict):
        if value.get("bytes"):
            return to_png(bytes(value["bytes"]), base_dir)
        if value.get("path"):
            return to_png(str(value["path"]), base_dir)
        raise ImageError(f"an image entry needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if raw.startswith(b"\x89PNG\r\n\x1a\n"):
            return raw
        try:
            return _png(Image.open(io.BytesIO(raw)))
        except OSError as e:
            raise ImageError(f"not a readable image ({len(raw)} bytes): {e}") from e
    if isinstance(value, str):
        if value.startswith("data:image/"):
            return to_png(base64.b64decode(value.partition(",")[2]), base_dir)
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise ImageError(
                f"image file {value!r} does not exist (relative paths are taken from the dataset's folder)"
            )
        return to_png(path.read_bytes(), base_dir)
    raise ImageError(
        f"an image must be a dict with bytes/path, a path, bytes or a PIL image, got {type(value).__name__}"
    )


def _png(img: Any) -> bytes:
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def open_png(png: bytes):
    """PNG bytes -> an RGB PIL image."""
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


def data_url(png: bytes) -> str:
    """The image as a `data:` URL: how an engine's request carries it (the engine decodes and processes it)."""
    return "data:image/png;base64," + base64.b64encode(png).decode()
