"""The trained model as Hugging Face files, and verl's per-rank FSDP checkpoint shards read back as full tensors.

One writer serves every way weights leave the trainer: the weight sync's disk export (each rank drains the engine's
all-gathering iterator, rank 0 writes), the run's final `checkpoints/step_N/hf/` (trainer.save_hf) and the offline
`python -m fully_async.export` (which merges a checkpoint's shards in one process, no ranks needed).

verl's FSDP2 checkpoint (`backend/` of a `checkpoints/step_N/`) holds, per rank r of W, `model_world_size_W_rank_r.pt`
(the module's state dict of DTensors, each sharded along dim 0 the way `torch.chunk` splits it),
`optim_world_size_W_rank_r.pt` (the optimizer's state dict: param-index keys, DTensor moments, the same sharding) and
`extra_state_world_size_W_rank_r.pt` (LR schedule, RNG). Concatenating the local shards in rank order gives the full
tensor, whatever W was: that is how a checkpoint is exported and how it is loaded at another world size.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

# At import (a trainer rank's start), not at the first export: it pulls fully_async.engines (~0.7 s here).
from fully_async.vllm_ext.fa_digest import DIGEST_KEY, INDEX, Digest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja",
               "preprocessor_config.json", "processor_config.json")  # fmt: skip
"""Files besides the weights that make a directory loadable by transformers and servable by vLLM (the last two: a
vision-language model's processor, docs/vlm.md)."""


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    dtype: str = "float32",
    bucket_bytes: int = 512 << 20,
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """Write `(name, full tensor)` pairs as safetensors shards of about `bucket_bytes` each plus the index; floating
    tensors are cast to `dtype`. Earlier weight files in `out_dir` are removed first. Returns the file names;
    `progress` hears of each file written. The index's metadata records DIGEST_KEY: fa_digest's checksum of the
    tensors as written (taken from memory while writing: a few ms at 100 M parameters), which a weight sync's
    proof compares with the engines' digests of what they loaded (fully_async/weights/verify.py)."""
    from safetensors.torch import save_file

    target = DTYPES[dtype]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model-*.safetensors")) + list(out.glob("model.safetensors*")):
        old.unlink()
    files: list[str] = []
    weight_map: dict[str, str] = {}
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    digest = Digest()

    def flush() -> None:
        nonlocal bucket, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(bucket, str(out / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(bucket, name))
        if progress:
            progress(f"wrote {name} ({len(bucket)} tensors, {size / 2**20:.1f} MiB)")
        bucket, size = {}, 0

    for name, tensor in tensors:
        t = tensor.detach()
        if t.is_floating_point():
            t = t.to(target)
        # clone: tied weights (embedding and LM head) are one storage, which safetensors refuses to write twice
        bucket[name] = t.to("cpu").contiguous().clone()
        digest.add(name, bucket[name])
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            flush()
    if bucket or not files:
        flush()
    total = sum((out / f).stat().st_size for f in files)
    metadata = {"total_size": total, DIGEST_KEY: digest.hexdigest()}
    (out / INDEX).write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=1))
    like_neighbours(out / INDEX, [out / f for f in files])
    return files


TIED_HEAD = "lm_head.weight"
"""The output layer's weight, which a model that ties its word embeddings shares with its token embedding."""
EMBEDDING_SUFFIX = "embed_tokens.weight"
"""How the token embedding's name ends (model.embed_tokens.weight; the language model's inside a VLM)."""


def ties_embeddings(config) -> bool:
    """Whether a Hugging Face config (a `PretrainedConfig`, or a directory holding config.json) ties the LM head to
    the token embedding: its `tie_word_embeddings`, the attribute transformers ties by, as transformers resolves it
    for the architecture (the default differs between them, so a directory is read through AutoConfig, not as
    JSON)."""
    if isinstance(config, (str, Path)):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(config))
    return bool(getattr(config, "tie_word_embeddings", False))


def without_tied_head(tensors: Iterable[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """What leaves the trainer for a model that ties its word embeddings: every (Hugging Face name, tensor) pair but
    `lm_head.weight`, lazily. Every path that moves weights applies it (the disk transport's export, staged or not;
    the collective transport's plan and send; the HF exports, trainer.save_hf and `python -m fully_async.export`;
    the engines' start on resume, which is a disk export), so a tied model's weights travel as `save_pretrained`
    writes them and the Hub holds them: the embedding once. Why: vLLM skips a tied model's head when it loads, the
    collective transport checks its plan against the engine's checkpoint (which has no head), transformers re-ties
    on load, and the head is the embedding's bytes again (28 M of SmolLM2's 135 M parameters). The sync's digests
    are taken over what is written or sent, so they agree with the engines' (which digest what their loader takes).
    A head that is not equal to the embedding it is tied to (a run that untied them, e.g. LoRA on lm_head) raises
    ValueError rather than dropping trained weights. The LoRA adapter-only sync sends the adapter alone, which holds
    neither. `tied` False: the pairs unchanged."""
    embedding = None
    for name, tensor in tensors:
        if not tied:
            yield name, tensor
            continue
        if name.endswith(EMBEDDING_SUFFIX):
            embedding = tensor
        if name != TIED_HEAD:
            yield name, tensor
        elif embedding is not None and not torch.equal(tensor, embedding):
            raise ValueError(f"the model ties its word embeddings, but {TIED_HEAD} differs from the embedding")


def like_neighbours(written: Path, saved: list[Path]) -> None:
    """Give `saved` (files safetensors' `save_file` wrote) the permission bits of `written` (a file written the
    ordinary way beside them). save_file creates its file owner-only (0600) whatever the umask, so an export read by
    an engine server of another user on a shared filesystem would be unreadable while its index and config are not.
    Copying a neighbour's mode honours the umask without os.umask, which is process-wide and not thread-safe (staged
    exports write in a thread)."""
    mode = written.stat().st_mode & 0o777
    for path in saved:
        path.chmod(mode)


FAILED_SUFFIX = ".failed"
"""Beside a staged export's directory `D`, the file `D.failed` holds why writing it failed (`write_staged`)."""

TRACEBACK_MARK = "\n--- the writer's traceback ---\n"
"""In a `.failed` file, between the reason (the error's one line) and the writer's traceback."""

STAGED_POLL_S = 0.001
"""How often `wait_for_staged` looks for the directory (a staged export of the default job writes in ~5 ms)."""


def write_staged(tensors: list[tuple[str, torch.Tensor]], out_dir: str | Path, dtype: str, bucket_bytes: int) -> None:
    """`write_safetensors` of tensors copied out of the model, into a hidden directory beside `out_dir` renamed to
    it when complete, so `out_dir` appears whole or not at all. Run in a thread while training goes on; a failure
    is written to `out_dir` + FAILED_SUFFIX for `wait_for_staged`, never raised into nothing."""
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.partial"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        write_safetensors(tensors, tmp, dtype, bucket_bytes)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException as e:  # noqa: BLE001 - reported through the file, the thread has no caller
        shutil.rmtree(tmp, ignore_errors=True)
        # Written beside it and renamed: wait_for_staged polls for the file and must never read it half written (an
        # empty reason was seen once under load).
        note = out.parent / f".{out.name}{FAILED_SUFFIX}.partial"
        note.write_text(f"{type(e).__name__}: {e}{TRACEBACK_MARK}{''.join(traceback.format_exception(e))}")
        note.rename(str(out) + FAILED_SUFFIX)


def wait_for_staged(out_dir: str | Path, timeout_s: float) -> None:
    """Wait until `write_staged` has put `out_dir` in place; RuntimeError with the writer's reason when it failed,
    TimeoutError after `timeout_s`."""
    out = Path(out_dir)
    failed = Path(str(out) + FAILED_SUFFIX)
    deadline = time.monotonic() + timeout_s
    while not out.is_dir():
        if failed.is_file():
            reason, _, trace = failed.read_text().partition(TRACEBACK_MARK)
            error = RuntimeError(f"writing the weights into {out} failed: {reason}")
            if trace:  # for the run's logs/error.log (job.record_failure); the message stays one line
                error.add_note(f"the writer's traceback (the rank's thread):\n{trace.rstrip()}")
            raise error
        if time.monotonic() > deadline:
            raise TimeoutError(f"the weights were not written into {out} within {timeout_s:g} s")
        time.sleep(STAGED_POLL_S)


def copy_model_files(sources: Iterable[str | Path], out_dir: str | Path) -> list[str]:
    """Copy MODEL_FILES into `out_dir` from the first of `sources` that has each (later sources fill gaps only);
    files already in `out_dir` are kept. Returns the names copied."""
    out = Path(out_dir)
    copied = []
    for name in MODEL_FILES:
        if (out / name).exists():
            continue
        for src in sources:
            if src is not None and (Path(src) / name).is_file():
                shutil.copy2(Path(src) / name, out / name)
                copied.append(name)
                break
    return copied


# ---------------------------------------------------------------------------------------- checkpoint shards
def shard_world_size(backend_dir: str | Path) -> int:
    """The world size that wrote a verl FSDP checkpoint directory, read from its file names."""
    sizes = {int(p.name.split("_")[3]) for p in Path(backend_dir).glob("model_world_size_*_rank_*.pt")}
    if len(sizes) != 1:
        raise FileNotFoundError(
            f"{backend_dir} holds no verl FSDP checkpoint (model_world_size_W_rank_R.pt)"
            if not sizes
            else f"{backend_dir} holds shards of several world sizes {sorted(sizes)}"
        )
    return sizes.pop()


def _local(value) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _concat(parts: list, what: str):
    """Join one entry's per-rank values: DTensor shards along their shard dim (rank order), others from rank 0."""
    first = parts[0]
    if not hasattr(first, "placements"):
        return first
    dims = {p.dim for p in first.placements if hasattr(p, "dim")}
    if not dims:  # replicated
        return _local(first)
    if len(dims) != 1 or len(first.placements) != 1:
        raise ValueError(f"{what}: cannot merge placements {first.placements} (one sharded dimension expected)")
    full = torch.cat([_local(p) for p in parts], dim=dims.pop())
    if tuple(full.shape) != tuple(first.shape):
        raise ValueError(f"{what}: the shards join to {tuple(full.shape)}, the checkpoint says {tuple(first.shape)}")
    return full


def _load_ranks(backend_dir: Path, kind: str, world: int, progress: Callable[[str], None] | None) -> list[dict]:
    out = []
    for r in range(world):
        path = backend_dir / f"{kind}_world_size_{world}_rank_{r}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint in {backend_dir} is incomplete")
        if progress:
            progress(f"reading {path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
        out.append(torch.load(path, map_location="cpu", weights_only=False))
    return out


def merged_model(backend_dir: str | Path, progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The module's full state dict from every rank's shard of a verl FSDP checkpoint (names as the module's)."""
    backend_dir = Path(backend_dir)
    ranks = _load_ranks(backend_dir, "model", shard_world_size(backend_dir), progress)
    return {name: _concat([r[name] for r in ranks], name) for name in ranks[0]}


def merged_optimizer(backend_dir: str | Path, progress: Callable[[str], None] | None = None) -> dict:
    """The optimizer's state dict (param-index keys, as torch saves it) with every moment joined to its full
    tensor, from every rank's shard."""
    backend_dir = Path(backend_dir)
    ranks = _load_ranks(backend_dir, "optim", shard_world_size(backend_dir), progress)
    state = {
        idx: {k: _concat([r["state"][idx][k] for r in ranks], f"optimizer state {idx}.{k}") for k in entry}
        for idx, entry in ranks[0]["state"].items()
    }
    return {"state": state, "param_groups": ranks[0]["param_groups"]}


def extra_state(backend_dir: str | Path, rank: int) -> dict:
    """LR-schedule and RNG state of `rank` (rank 0's when the checkpoint had fewer ranks: the schedule is the same on
    every rank; the RNG stream of a new rank starts from rank 0's)."""
    backend_dir = Path(backend_dir)
    world = shard_world_size(backend_dir)
    path = backend_dir / f"extra_state_world_size_{world}_rank_{rank if rank < world else 0}.pt"
    return torch.load(path, map_location="cpu", weights_only=False)
