"""The one place a weight transport is chosen: `transport_class` for an async_training.weight_transport value (or
"adapter", the job's choice for a LoRA run that syncs adapters), `build_transport` to make one. Kept apart from
base.py, which every transport imports, so that no module imports one that imports it back (like
training/factory.py); each transport is imported on demand (the collective one pulls torch.distributed).

A value `pkg.module:Class` names a transport written outside this package (a WeightTransport subclass, built as
`Class(rollouter, backend, weights_root, dtype, verify=verify)`): a new transport needs no file of fully_async.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fully_async.weights.base import WeightTransport, resolve_kind

KEY = "async_training.weight_transport"


def transport_class(kind: str) -> type[WeightTransport]:
    """The class that `kind` names: disk | collective | auto, "adapter", or a dotted path 'pkg.module:Class'."""
    if ":" in kind:
        from fully_async.config import ConfigError
        from fully_async.plugins import load

        cls = load(kind, KEY)
        if not (isinstance(cls, type) and issubclass(cls, WeightTransport)):
            raise ConfigError(f"{KEY}={kind!r} must name a WeightTransport subclass (fully_async/weights/base.py)")
        return cls
    if kind == "adapter":
        from fully_async.weights.lora import LoraTransport

        return LoraTransport
    if resolve_kind(kind) == "disk":
        from fully_async.weights.disk import DiskTransport

        return DiskTransport
    from fully_async.weights.collective import CollectiveTransport

    return CollectiveTransport


def build_transport(
    kind: str,
    rollouter: Any,
    backend: Any,
    weights_root: str | Path,
    dtype: str,
    verify: bool = True,
    **collective: Any,
) -> WeightTransport:
    """The transport `kind` names (see `transport_class`), for `backend`'s weights in the engines' `dtype`.
    `weights_root`: where disk-based paths write (the disk transport, and `export` of any transport). `collective`:
    the collective transport's options, with their defaults there (CollectiveTransport: bucket_mb, sync_timeout_s,
    of which its group timeout is a share, device, cpu: gloo, cuda: nccl, and staging); the adapter transport takes
    `device`, the others none. `verify`: async_training.verify_sync (every sync proven by the engines' digests,
    weights/verify.py)."""
    cls = transport_class(kind)
    if ":" not in kind and cls.name == "collective":
        return cls(rollouter, backend, weights_root, dtype, verify=verify, **collective)
    if ":" not in kind and cls.name == "adapter":
        return cls(rollouter, backend, weights_root, dtype, device=collective.get("device", "cpu"), verify=verify)
    return cls(rollouter, backend, weights_root, dtype, verify=verify)
