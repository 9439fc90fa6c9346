"""Which checkpoint names are a vision-language model's vision tower, and the pairs a weight sync sends without it.

The sync's side of model.freeze_vision_tower (docs/vlm.md): with the tower frozen, the engines keep the tower they
loaded from model.path, so a sync (and its digest) covers the language model's tensors only. The sender applies it
itself (collective_sender.py `CollectiveSender(tower_frozen=True)`), whatever it is handed; the trainer side (freezing
the parameters, LoRA's exclusion) is training/vision_tower.py, which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

TOWER = "visual"
"""The name component of the vision tower's module in the Qwen-VL family (checkpoint and module names alike)."""


def is_tower(name: str) -> bool:
    """Whether tensor `name` is one of the vision tower's: Hugging Face's checkpoint name `visual.*`, transformers'
    module name `model.visual.*`, or either under PEFT's `base_model.model.` prefix (the patch embedding, the vision
    blocks and the merger that projects into the language model)."""
    return TOWER in name.split(".")


def without_tower(named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """`named` without the tower's pairs. The iterator is drained to the end even for the pairs it drops: on a
    trainer rank each step of it may be a collective every rank takes in the same order."""
    for name, tensor in named:
        if not is_tower(name):
            yield name, tensor
