"""LoRA on the trainer side: the adapter and the merged model out of a PEFT-wrapped policy's tensors.

With model.lora.rank > 0, verl's FSDP engine wraps the policy in a PEFT model: its module names read
`base_model.model.<hf name>`, a targeted linear layer keeps its frozen weight as `<layer>.base_layer.weight` beside
`<layer>.lora_A.default.weight` (rank x in) and `<layer>.lora_B.default.weight` (out x rank), and its output is
`W x + (alpha / rank) B A x`. Everything that leaves the trainer is derived here from (name, full tensor) pairs in
the module's order, the same in a live rank (gathered one tensor at a time) and in an offline checkpoint:

- `adapter_tensors`: the adapter as PEFT saves it (`adapter_model.safetensors`: `lora_A.weight`, no adapter name),
  which `peft.PeftModel.from_pretrained` and vLLM's `/v1/load_lora_adapter` load;
- `merged_tensors`: the merged model under Hugging Face names (`W + (alpha / rank) B A`), which every full-weight
  transport and `model.path` take unchanged.

The merge is ours, on full tensors, rather than verl's `merged_lora_context`: that one merges only inside FSDP
units below the root (the CPU default wraps the whole model as one unit, so nothing would merge and the engines
would silently keep the base model), and it casts to bfloat16.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

PREFIX = "base_model.model."
"""What PEFT puts in front of the wrapped model's names."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PARTS = (".lora_A.", ".lora_B.")


def is_adapter(name: str) -> bool:
    """Whether a module name (or a PEFT file name) is one of the adapter's tensors."""
    return any(p in name for p in _PARTS)


def peft_name(name: str, adapter: str = "default") -> str:
    """The name PEFT writes in adapter_model.safetensors for module tensor `name` (the adapter's name dropped)."""
    return name.replace(f".{adapter}.", ".")


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's (PEFT file name, tensor) pairs among a PEFT model's (module name, tensor) pairs."""
    for name, tensor in named:
        if is_adapter(name):
            yield peft_name(name), tensor


def hf_name(name: str) -> str:
    """The Hugging Face name of a PEFT module tensor that is not the adapter's."""
    return name.removeprefix(PREFIX).replace(".base_layer.", ".")


def merged_tensors(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of the merged model from a PEFT model's (module name, full tensor) pairs in any
    order: each adapted layer's weight becomes `W + scaling * B @ A` (computed in float32, returned in W's dtype),
    every other tensor passes unchanged. A layer's weight is held back only until its A and B have come by (PEFT's
    state-dict order puts them right after it), so this streams."""
    pending: dict[str, dict[str, torch.Tensor]] = {}

    def ready(layer: str):
        parts = pending[layer]
        if len(parts) < 3:
            return None
        del pending[layer]
        w, a, b = parts["W"], parts["A"], parts["B"]
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * scaling
        return hf_name(layer + ".weight"), (w.to(torch.float32) + delta).to(w.dtype)

    for name, tensor in named:
        if ".base_layer.weight" in name:
            layer, part = name.removesuffix(".base_layer.weight"), "W"
        elif is_adapter(name):
            layer, rest = name.split(".lora_", 1)
            part = rest[0]  # A or B
        else:
            yield hf_name(name), tensor
            continue
        pending.setdefault(layer, {})[part] = tensor
        if (out := ready(layer)) is not None:
            yield out
    if pending:
        raise ValueError(f"LoRA layers without weight, A and B: {sorted(pending)[:3]} ({len(pending)} in all)")


def write_adapter(
    tensors: Iterable[tuple[str, torch.Tensor]], config: dict, out_dir: str | Path, dtype: str = "float32"
) -> str:
    """Write a PEFT adapter directory (adapter_model.safetensors + adapter_config.json) from its (PEFT name,
    tensor) pairs, floating tensors cast to `dtype`; returns `fa_digest.digest` over the tensors as written."""
    from safetensors.torch import save_file

    from fully_async.training.hf_files import DTYPES, like_neighbours
    from fully_async.vllm_ext.fa_digest import digest

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = DTYPES[dtype]
    written = {
        name: (t.detach().to(target) if t.is_floating_point() else t.detach()).to("cpu").contiguous()
        for name, t in tensors
    }
    if not written:
        raise ValueError("no adapter tensors to write (is LoRA on?)")
    save_file(written, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    like_neighbours(out / ADAPTER_CONFIG, [out / ADAPTER_WEIGHTS])
    return digest(written.items())


def adapter_config(peft_config, base_model: str | None = None) -> dict:
    """adapter_config.json's contents for a live `peft.LoraConfig` (sets as sorted lists, enums as strings)."""
    raw = peft_config.to_dict()
    out = {}
    for key, value in raw.items():
        if isinstance(value, set):
            value = sorted(value)
        elif hasattr(value, "value"):  # enums (task_type, peft_type)
            value = value.value
        out[key] = value
    if base_model is not None:
        out["base_model_name_or_path"] = base_model
    return out


def scaling(config: dict) -> float:
    """The adapter's output scale from its adapter_config (alpha / rank; alpha / sqrt(rank) with rsLoRA)."""
    r, alpha = config["r"], config["lora_alpha"]
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("adapters with per-layer rank or alpha patterns are not supported")
    return alpha / (r**0.5 if config.get("use_rslora") else r)
