"""The engine side of the adapter sync's proof: the checksum of the LoRA adapter a vLLM worker holds under a name.

`fa_adapter_digest(spec)` (spec: JSON {"name": "policy-vN"}) is a worker-extension method (a base of
`fa_weight_receiver.WeightReceiver`), called through /collective_rpc after `/v1/load_lora_adapter`. It digests the
tensors vLLM's LoRA manager holds for that adapter in the worker (its CPU-side LoRAModel: what every request naming
the adapter is served from), under the PEFT file's names, with `fa_digest.digest`.

vLLM's layout is not the file's: on loading it stacks q/k/v and gate/up into packed modules (each sub-module's
tensors kept apart in a list, so they map back by name) and folds the scaling (alpha / rank) into lora_B
(`lora_b *= scaling`), which cannot be undone exactly. So both sides digest vLLM's layout: the trainer side digests the
file's tensors with lora_B scaled the same way (`folded`: the same multiplication, hence the same bytes), and
equality means "this worker serves exactly the adapter in that file".

The worker knows adapters by integer id only (the API server keeps the name -> id map), so importing this module in
the worker wraps vLLM's `LRUCacheWorkerLoRAManager.add_adapter` to record name -> id and the adapter's directory as
adapters load (idempotent; nothing else changes). A vision-language model's modules are renamed by vLLM on loading;
`file_modules` maps them back to the file's names from the directory's tensor names. Imports only the standard
library, torch and (in the worker, when present) vLLM and safetensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator

import torch

try:
    from fa_digest import digest  # in the engine's interpreter this directory alone is on PYTHONPATH
except ImportError:  # imported as part of fully_async (the trainer's side)
    from fully_async.vllm_ext.fa_digest import digest

PEFT_PREFIX = "base_model.model."


def scaling(adapter_config: dict) -> float:
    """PEFT's scaling of an adapter's output: lora_alpha / r (alpha / sqrt(r) with rsLoRA), as vLLM computes it."""
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


def folded(named: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT file's (name, tensor) pairs in vLLM's loaded layout: lora_B multiplied by `scale` (vLLM's
    `LoRALayerWeights.optimize`), lora_A as it is."""
    for name, tensor in named:
        if ".lora_B." in name and scale != 1:
            tensor = tensor.clone()
            tensor *= scale
        yield name, tensor


def file_modules(manager, adapter_dir: str) -> dict[str, str]:
    """vLLM's module name -> the adapter file's module name (without PEFT's prefix), for each module the file adapts.

    vLLM renames a vision-language model's modules on loading (Qwen2-VL's `model.language_model.layers.0...` is its
    `language_model.model.layers.0...`, by the model's `hf_to_vllm_mapper`), so the names it holds are not the file's.
    This reads the file's tensor names (the header only) and maps each the way the loader did (vLLM's
    `parse_fine_tuned_lora_name` with the model's rename mapper), so the digest is under the file's names again.
    A text model's names map to themselves."""
    from safetensors import safe_open
    from vllm.lora.utils import parse_fine_tuned_lora_name

    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    with safe_open(f"{adapter_dir}/adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    back = {}
    for key in keys:
        if ".lora_A." not in key:
            continue
        module, _ = parse_fine_tuned_lora_name(key, mapper)
        back[module] = key.removeprefix(PEFT_PREFIX).rsplit(".lora_A.", 1)[0]
    return back


def _held(manager, lora_model, names: dict[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, tensor) of every lora_A / lora_B a loaded LoRAModel holds; packed modules (qkv_proj, gate_up_proj)
    are split back into their sub-modules by the manager's packing map, and `names` (`file_modules`) turns vLLM's
    module names back into the adapter file's."""
    names = names or {}
    packed = getattr(manager, "packed_modules", {})
    for module, weights in lora_model.loras.items():
        if isinstance(weights.lora_a, list):
            subs = packed.get(module)
            if subs is None or len(subs) != len(weights.lora_a):
                raise RuntimeError(
                    f"packed LoRA module {module!r}: no sub-module names for {len(weights.lora_a)} parts"
                )
            parts = list(zip(subs, weights.lora_a, weights.lora_b))
        else:
            parts = [(module, weights.lora_a, weights.lora_b)]
        for sub, a, b in parts:
            if a is None:  # a sub-module the adapter does not target
                continue
            sub = names.get(sub, sub)
            yield f"{PEFT_PREFIX}{sub}.lora_A.weight", a
            yield f"{PEFT_PREFIX}{sub}.lora_B.weight", b


def _record_names() -> None:
    """Make the worker's LoRA manager remember name -> integer id of each adapter it loads (see the module
    docstring). A no-op outside vLLM, and when already done."""
    try:
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    except ImportError:
        return
    if getattr(LRUCacheWorkerLoRAManager.add_adapter, "_fa_records", False):
        return
    original = LRUCacheWorkerLoRAManager.add_adapter

    def add_adapter(self, lora_request):
        loaded = original(self, lora_request)
        names = self.__dict__.setdefault("_fa_names", {})
        names[lora_request.lora_name] = lora_request.lora_int_id
        self.__dict__.setdefault("_fa_paths", {})[lora_request.lora_name] = lora_request.lora_path
        return loaded

    add_adapter._fa_records = True
    LRUCacheWorkerLoRAManager.add_adapter = add_adapter


_record_names()


class AdapterDigest:
    """Worker-extension methods for LoRA adapters (mixed into every vLLM worker through WeightReceiver)."""

    def fa_adapter_digest(self, spec: str) -> dict:
        """{"digest": fa_digest of the adapter loaded as spec's "name", in vLLM's layout (see `folded`), "source":
        the name}. Raises when this worker has no adapter of that name (never loaded, or evicted from the CPU
        cache)."""
        name = json.loads(spec)["name"]
        worker_manager = getattr(self.model_runner, "lora_manager", None)
        if worker_manager is None:
            raise RuntimeError("LoRA is not enabled on this engine (--enable-lora)")
        lora_id = getattr(worker_manager, "_fa_names", {}).get(name)
        manager = worker_manager._adapter_manager
        lora_model = manager.get_adapter(lora_id) if lora_id is not None else None
        if lora_model is None:
            raise RuntimeError(f"no LoRA adapter {name!r} is loaded in this worker")
        names = file_modules(manager, worker_manager._fa_paths[name])
        return {"digest": digest(_held(manager, lora_model, names)), "source": name}
