"""A cheap, order-independent checksum of a set of named tensors: the proof that a weight sync landed.

The trainer side digests the tensors it sends (or writes), the engine side the tensors it loaded, and ParamSync
compares the two per server. Used by the engine's worker extension as well as by fully_async, so this module imports
only the standard library and torch, never fully_async.

Each tensor contributes its name, shape, dtype and the bytes of SAMPLES elements taken at evenly spaced positions
(the first and the last included; every element when it has fewer), so the cost does not grow with the model: a
tensor that did not arrive, arrived from another version, with another shape or in another dtype changes the digest;
a change confined to elements between two samples may not (`samples=0` hashes every element).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

SAMPLES = 1024
"""Elements sampled per tensor (0 = all of them)."""


def tensor_digest(name: str, tensor: torch.Tensor, samples: int = SAMPLES) -> bytes:
    """16 bytes that stand for (name, shape, dtype, sampled values) of one tensor."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if samples and n > samples:
        index = torch.linspace(0, n - 1, samples, device=flat.device).round().long()
        flat = flat[index]
    raw = flat.contiguous().cpu().view(torch.uint8).numpy().tobytes()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{tuple(tensor.shape)}|{str(tensor.dtype).removeprefix('torch.')}|".encode())
    h.update(raw)
    return h.digest()


class Digest:
    """Accumulates tensors in any order (the trainer sends in its order, an engine loads in its own);
    `hexdigest()` is the same for the same set of (name, tensor)."""

    def __init__(self, samples: int = SAMPLES) -> None:
        self.samples = samples
        self._parts: dict[str, bytes] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._parts[name] = tensor_digest(name, tensor, self.samples)

    def update(self, named: Iterable[tuple[str, torch.Tensor]]) -> Digest:
        for name, tensor in named:
            self.add(name, tensor)
        return self

    def __len__(self) -> int:
        return len(self._parts)

    def hexdigest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self._parts):
            h.update(self._parts[name])
        return h.hexdigest()


def digest(named: Iterable[tuple[str, torch.Tensor]], samples: int = SAMPLES) -> str:
    """The checksum of (name, tensor) pairs, in any order."""
    return Digest(samples).update(named).hexdigest()
