"""A cheap, order-independent checksum of a set of named tensors: the proof that a weight sync landed.

The trainer side digests the tensors it sends (or writes), the engine side the tensors it loaded, and ParamSync
compares the two per server. Used by the engine's worker extension as well as by fully_async, so this module imports
only the standard library and torch, never fully_async.

Each tensor contributes its name, shape, dtype and the bytes of SAMPLES elements taken at evenly spaced positions
(the first and the last included; every element when it has fewer), so the cost does not grow with the model: a
tensor that did not arrive, arrived from another version, with another shape or in another dtype changes the digest;
a change confined to elements between two samples may not (`samples=0` hashes every element).

`directory_digest` digests a directory of safetensors files by memory-mapping them: only the pages that hold the
sampled elements are read (in practice most pages of a large tensor: ~0.1-0.2 s at 101 M parameters here), so a
writer that can records the digest of what it wrote in the index's metadata instead (`DIGEST_KEY`, read back by
`recorded_digest`). torch is imported where a tensor is digested, so a directory without tensors costs no import.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SAMPLES = 1024
"""Elements sampled per tensor (0 = all of them)."""


def tensor_digest(name: str, tensor: torch.Tensor, samples: int = SAMPLES) -> bytes:
    """16 bytes that stand for (name, shape, dtype, sampled values) of one tensor."""
    import torch

    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if samples and n > samples:
        # Exact integers: a float32 linspace rounds n - 1 up to n past 2**24 elements (issue 48: an IndexError on
        # SmolLM2's 49,152 x 576 embedding), and any rounding there would pick other elements on the two sides.
        steps = torch.arange(samples, dtype=torch.int64, device=flat.device)
        index = steps * (n - 1) // max(1, samples - 1)
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


SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
"""safetensors dtype codes read by `safetensors_tensors`, with their torch dtype names (the float8 codes are not: no
weights here use them)."""

INDEX = "model.safetensors.index.json"
"""The index of a sharded safetensors checkpoint (Hugging Face's name)."""
DIGEST_KEY = "fa_digest"
"""The key, in INDEX's metadata, of the digest of the tensors the writer wrote (training/hf_files.py)."""


def safetensors_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the safetensors file `path`, each a view of a private (copy-on-write) memory
    map of the file: nothing is read until touched, and nothing written reaches the file. The format: 8 bytes of
    little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data."""
    import torch

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        empty = os.fstat(f.fileno()).st_size == 8 + length  # only empty tensors: nothing to map
        data = None if empty else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which this reader does not know")
        dtype = getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])
        start, end = entry["data_offsets"]
        count = (end - start) // torch.empty((), dtype=dtype).element_size()
        flat = (
            torch.frombuffer(data, dtype=dtype, count=count, offset=8 + length + start)
            if count
            else torch.empty(0, dtype=dtype)
        )
        yield name, flat.view(entry["shape"])


def directory_digest(directory: str, samples: int = SAMPLES) -> tuple[str, int]:
    """(checksum, number of tensors) of every tensor in the `*.safetensors` files directly under `directory`, as
    `digest` computes it for the same tensors loaded into memory."""
    d = Digest(samples)
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            d.update(safetensors_tensors(os.path.join(directory, file)))
    return d.hexdigest(), len(d)


def recorded_digest(directory: str) -> str | None:
    """The digest the writer of `directory` recorded in its index's metadata (DIGEST_KEY), None when there is none."""
    try:
        with open(os.path.join(directory, INDEX)) as f:
            recorded = json.load(f)["metadata"][DIGEST_KEY]
    except (FileNotFoundError, KeyError, TypeError, ValueError):  # no index, or one another writer made
        return None
    return str(recorded) if recorded else None
