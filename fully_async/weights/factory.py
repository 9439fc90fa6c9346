"""build_transport: the weight transport named by the config. Kept apart from base.py, which every transport
imports, so that no module imports one that imports it back (like training/factory.py); each transport is imported
on demand (the collective one pulls torch.distributed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fully_async.weights.base import WeightTransport, resolve_kind


def build_transport(
    kind: str,
    rollouter: Any,
    backend: Any,
    weights_root: str | Path,
    dtype: str,
    verify: bool = True,
    **collective: Any,
) -> WeightTransport:
    """The transport named by async_training.weight_transport, for `backend`'s weights in the engines' `dtype`.
    `weights_root`: where disk-based paths write (the disk transport, and `export` of any transport). `collective`:
    the collective transport's options, with their defaults there (CollectiveTransport: bucket_mb, sync_timeout_s,
    of which its group timeout is a share, device, cpu: gloo, cuda: nccl, and staging); the disk transport takes none.
    `verify`: async_training.verify_sync (every sync proven by the engines' digests, weights/verify.py).
    `kind` "adapter" (not a weight_transport value: the job picks it when model.lora syncs adapters,
    weights/lora.py `adapter_sync_plan`): the LoRA adapter transport."""
    if kind == "adapter":
        from fully_async.weights.lora import LoraTransport

        return LoraTransport(rollouter, backend, weights_root, dtype, device=collective.get("device", "cpu"),
                             verify=verify)  # fmt: skip
    if resolve_kind(kind) == "disk":
        from fully_async.weights.disk import DiskTransport

        return DiskTransport(rollouter, backend, weights_root, dtype, verify)
    from fully_async.weights.collective import CollectiveTransport

    return CollectiveTransport(rollouter, backend, weights_root, dtype, verify=verify, **collective)
