"""The names a Hugging Face checkpoint gives the policy's tensors, where they differ from the trainer's module names.

Contract: `checkpoint_names(tensors, model_type)` renames `(module name, tensor)` pairs to the names a checkpoint of
that architecture carries on the Hub and from `save_pretrained`; every other model type (all the text models) keeps
its names. `model_type(dirs)` reads it from the first of `dirs` with a config.json.

Why: transformers (>= 4.52, and 5.x here) lays Qwen2-VL and Qwen2.5-VL out as `model.visual.*` and
`model.language_model.*` in memory, while their checkpoints (the Hub's, and what `save_pretrained` writes: it
reverses transformers' load-time renaming) keep the original `visual.*` and `model.*`. The trainer's tensors carry
the in-memory names. The HF exports (trainer.save_hf, `python -m fully_async.export`) write the checkpoint's names,
so an export reads like the model it came from, in tools that know only that layout too. A weight sync keeps the
module names: vLLM maps both layouts, and the sync's digest is taken over what is sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

CHECKPOINT_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_vl": (("model.visual.", "visual."), ("model.language_model.", "model.")),
    "qwen2_5_vl": (("model.visual.", "visual."), ("model.language_model.", "model.")),
}
"""model_type -> (module-name prefix, checkpoint-name prefix), the first that matches a name applies."""


def checkpoint_name(name: str, model_type: str | None) -> str:
    """`name` (the trainer's module name) as a checkpoint of `model_type` spells it."""
    for module_prefix, ckpt_prefix in CHECKPOINT_PREFIXES.get(model_type or "", ()):
        if name.startswith(module_prefix):
            return ckpt_prefix + name[len(module_prefix) :]
    return name


def checkpoint_names(
    tensors: Iterable[tuple[str, torch.Tensor]], model_type: str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs of `tensors`, lazily (a rank's gathering iterator stays one tensor at a time), under checkpoint names."""
    for name, tensor in tensors:
        yield checkpoint_name(name, model_type), tensor


def model_type(dirs: Iterable[str | Path | None]) -> str | None:
    """config.json's `model_type` in the first of `dirs` that has one (None when none does)."""
    for d in dirs:
        if d is not None and (Path(d) / "config.json").is_file():
            return json.loads((Path(d) / "config.json").read_text()).get("model_type")
    return None
