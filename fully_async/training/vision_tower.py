"""The frozen vision tower of a vision-language model (model.freeze_vision_tower, docs/vlm.md).

Contract:
- `is_tower(name)`: whether a tensor name (Hugging Face's checkpoint name `visual.*`, transformers' module name
  `model.visual.*`, or either under PEFT's `base_model.model.` prefix) belongs to the tower: the patch embedding,
  the vision blocks and the merger that projects into the language model (verl's freeze_vision_tower freezes the
  same `visual` module of Qwen2-VL, Qwen2.5-VL and Qwen3-VL).
- `freeze(module)`: the tower's parameters stop requiring a gradient, before FSDP wraps the module and before the
  optimizer is built (which then holds no state for them); returns how many parameters it froze.
- `without_tower(named)` (weights/tower.py, with `is_tower`: the names are the sync's business): (name, tensor) pairs with the tower's left out: what a weight sync sends when the tower is
  frozen. The engines keep the tower they loaded from model.path, which is the frozen tower's value for the whole
  run, and the proof of the sync (the digest) is taken over exactly these pairs.

A text model has no tower: `freeze` freezes nothing and `without_tower` passes every pair through.
"""

from __future__ import annotations

import torch

from fully_async.weights.tower import TOWER, is_tower, without_tower

__all__ = ["LORA_EXCLUDE", "TOWER", "freeze", "is_tower", "without_tower"]


def freeze(module: torch.nn.Module) -> int:
    """Stop the tower's parameters from requiring a gradient; the number of tensors frozen (0 for a text model)."""
    frozen = 0
    for name, param in module.named_parameters():
        if is_tower(name):
            param.requires_grad_(False)
            frozen += 1
    return frozen


LORA_EXCLUDE = r"(.*\.)?visual(\..*)?"
"""PEFT's exclude_modules (a regex it matches against whole module names): LoRA adapts the language model only,
never a module of the tower (with target_modules=all-linear it would otherwise wrap the tower's linears too)."""
