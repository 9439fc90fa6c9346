"""The collective transport's sending side, which runs where the full weights are (the training backend's rank 0,
or the test process): the bucket layout, packing and digest, the staging buffers of background syncs, and
CollectiveSender, which opens the group's store, joins as rank 0 and broadcasts. The driver's side (the transport
ParamSync runs) is weights/collective.py; the engines' side is fully_async/vllm_ext/fa_weight_receiver.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from fully_async.config.sections.advanced import STAGINGS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Engine dtypes the transport sends in, with their element sizes."""

GROUP_TIMEOUT_FRACTION = 0.5
"""The group's per-operation timeout as a share of advanced.sync_timeout_s: a peer that stops answering fails
the operation (and names itself) well before the watchdog cuts the phase."""


class TransportError(RuntimeError):
    """The collective transport could not move a version; the message names the tensor or the servers."""


# ---- layout: pure, shared by the sender and (as JSON) the engines ------------------------------------------------
def make_plan(named_shapes: Iterable[tuple[str, Any]]) -> list[list]:
    """[[name, [dims...]], ...] in the sender's iteration order."""
    return [[str(name), [int(d) for d in shape]] for name, shape in named_shapes]


def numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def layout_buckets(plan: list[list], dtype: str, bucket_bytes: int) -> list[dict]:
    """Split `plan` (in order) into flat buckets of at most `bucket_bytes` in `dtype` (a tensor larger than that gets
    a bucket of its own): [{"numel": n, "tensors": [[name, shape, offset, numel], ...]}, ...]. Offsets are elements
    into the bucket. Deterministic: the sender packs and every engine unpacks from this one layout."""
    if dtype not in DTYPE_BYTES:
        raise TransportError(f"engine dtype {dtype!r} cannot be sent; one of {sorted(DTYPE_BYTES)}")
    if bucket_bytes < 1:
        raise TransportError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
    limit = max(1, bucket_bytes // DTYPE_BYTES[dtype])
    buckets: list[dict] = []
    current: list[list] = []
    size = 0
    for name, shape in plan:
        n = numel(shape)
        if current and size + n > limit:
            buckets.append({"numel": size, "tensors": current})
            current, size = [], 0
        current.append([name, list(shape), size, n])
        size += n
    if current:
        buckets.append({"numel": size, "tensors": current})
    return buckets


def _torch_dtype(dtype: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def pack_and_send(
    tensors: Iterator[tuple[str, Any]],
    buckets: list[dict],
    dtype: str,
    device: Any,
    broadcast: Callable[[Any], Any],
    buffers: list | None = None,
) -> dict[str, float]:
    """Copy `tensors` (in plan order) into the flat buckets of `buckets`, cast to `dtype`, and hand each full bucket
    to `broadcast(flat) -> work` (an async op with .wait()). Two buffers alternate, so bucket k+1 is packed while
    bucket k is on the wire. A tensor out of plan order, with another shape, or not floating, raises TransportError
    naming it (after waiting for what is already on the wire). `buffers`: a list this call fills with its two
    buffers, or takes them from when they fit (a caller that keeps it across sends packs into memory already
    touched: on these machines first-touch page faults cost more than the copy). Returns bytes, seconds spent
    packing / waiting / digesting, and `digest`: fa_digest's checksum of the tensors as sent (cast and packed), which
    the engines' digests of what they loaded must equal (weights/verify.py)."""
    import torch

    target = _torch_dtype(dtype)
    cap = max((b["numel"] for b in buckets), default=0)
    need = min(2, len(buckets))
    if buffers is None:
        buffers = []
    fits = len(buffers) >= need and all(
        b.dtype == target and b.numel() >= cap and b.device.type == torch.device(device).type for b in buffers[:need]
    )
    if not fits:
        buffers[:] = [torch.empty(cap, dtype=target, device=device) for _ in range(need)]
    pending: list[Any] = [None, None]
    packed_s = wait_s = digest_s = 0.0
    sent = 0
    digest = _new_digest()
    it = iter(tensors)
    try:
        for k, bucket in enumerate(buckets):
            slot = k % 2
            if pending[slot] is not None:  # this buffer's previous bucket must be off the wire before reuse
                t0 = time.monotonic()
                pending[slot].wait()
                pending[slot] = None
                wait_s += time.monotonic() - t0
            flat = buffers[slot][: bucket["numel"]]
            t0 = time.monotonic()
            pack_bucket(it, bucket, flat)
            t1 = time.monotonic()
            packed_s += t1 - t0
            digest_bucket(digest, bucket, flat)
            digest_s += time.monotonic() - t1
            pending[slot] = broadcast(flat)
            sent += bucket["numel"] * flat.element_size()
        no_more_tensors(it)
    finally:
        for work in pending:
            if work is not None:
                t0 = time.monotonic()
                work.wait()
                wait_s += time.monotonic() - t0
    return {"bytes": float(sent), "pack_s": packed_s, "wait_s": wait_s, "digest": digest.hexdigest(),
            "digest_s": digest_s}  # fmt: skip


def pack_bucket(tensors: Iterator[tuple[str, Any]], bucket: dict, flat: Any) -> None:
    """Copy the next tensors of `tensors` into `flat` (one bucket of `layout_buckets`, its numel long), cast to its
    dtype. A tensor out of plan order, with another shape, or not floating, raises TransportError naming it."""
    for name, shape, offset, n in bucket["tensors"]:
        got = next(tensors, None)
        if got is None:
            raise TransportError(f"the sender ran out of tensors before {name!r} (the plan has more)")
        got_name, tensor = got
        if got_name != name:
            raise TransportError(f"the sender yielded tensor {got_name!r} where the plan has {name!r}")
        if list(tensor.shape) != list(shape):
            raise TransportError(f"tensor {name!r} has shape {list(tensor.shape)}, the plan has {shape}")
        if not tensor.is_floating_point():
            raise TransportError(f"tensor {name!r} is {tensor.dtype}; only floating tensors are sent")
        flat[offset : offset + n].copy_(tensor.detach().reshape(-1))


def _new_digest() -> Any:
    from fully_async.vllm_ext.fa_digest import Digest

    return Digest()


def digest_bucket(digest: Any, bucket: dict, flat: Any) -> None:
    """Add every tensor of one packed bucket to `digest`, as the engines see it: a view of `flat` in its shape."""
    for name, shape, offset, n in bucket["tensors"]:
        digest.add(name, flat[offset : offset + n].view(shape))


def no_more_tensors(tensors: Iterator[tuple[str, Any]]) -> None:
    if next(tensors, None) is not None:
        raise TransportError("the sender has more tensors than the plan")


def staging_bytes(plan: list[list], dtype: str) -> int:
    """Bytes of the staging copy a background sync keeps: every tensor of `plan` in the engine `dtype`."""
    return sum(numel(shape) for _, shape in plan) * DTYPE_BYTES[dtype]


def staging_buffers(buckets: list[dict], dtype: str, staging: str, device: str) -> list:
    """One flat buffer per bucket for a background sync's copy of the weights (advanced.staging): `device`: on
    the sender's `device`; `pinned`: pinned host memory when `device` is cuda, plain host memory on cpu (pinning
    needs an accelerator; the send path is the same)."""
    import torch

    if staging not in STAGINGS:
        raise TransportError(f"staging must be one of {list(STAGINGS)}, got {staging!r}")
    target = _torch_dtype(dtype)
    if staging == "device":
        return [torch.empty(k["numel"], dtype=target, device=device) for k in buckets]
    pin = device == "cuda"
    return [torch.empty(k["numel"], dtype=target, device="cpu", pin_memory=pin) for k in buckets]


def staging_place(staging: str, device: str) -> str:
    """Where `staging_buffers` puts the copy, in words (the message a background sync prints once)."""
    if staging == "device":
        return f"a second copy on the trainer's device ({device})"
    if device == "cuda":
        return "pinned host memory (sent through the two bucket buffers on the device)"
    return "host memory (staging=pinned on cpu: plain host memory, sent through the two bucket buffers like on GPUs)"


def staged_tensors(buckets: list[dict], staging: list) -> Iterator[tuple[str, Any]]:
    """The staged copy as (name, view into its bucket) in plan order: what `pack_and_send` packs from."""
    for bucket, flat in zip(buckets, staging):
        for name, shape, offset, n in bucket["tensors"]:
            yield name, flat[offset : offset + n].view(shape)


# ---- the sending side --------------------------------------------------------------------------------------------
class CollectiveSender:
    """Rank 0 of the weight group, in the process that holds the full tensors. `named_tensors()` gives a fresh
    iterator of (checkpoint name, full tensor) in a fixed order each call; `device`: where they live (cpu | cuda).
    `tower_frozen` (model.freeze_vision_tower on a vision-language model): the sender itself leaves the vision
    tower's tensors out of the plan, the sends and the digest, whatever `named_tensors` holds: the engines keep the
    tower they loaded from model.path (training/vision_tower.py); the iterator is still drained to its end."""

    def __init__(
        self, named_tensors: Callable[[], Iterable[tuple[str, Any]]], device: str = "cpu", *, tower_frozen: bool = False
    ) -> None:
        _new_digest()  # its import (fully_async.engines, ~0.7 s here) at the transport's set-up, not in a send
        if tower_frozen:
            from fully_async.weights.tower import without_tower

            source = named_tensors

            def named_tensors() -> Iterator[tuple[str, Any]]:
                return without_tower(source())

        self.named_tensors, self.device = named_tensors, device
        self.store = None
        self.pg = None
        self.group: str | None = None
        self.buffers: list = []
        """The two pack buffers, kept from one send to the next (see pack_and_send)."""
        self.staging: list = []
        """Background syncs: one flat buffer per bucket holding a copy of the weights, kept from one sync to the next."""
        self._staging_kind: str | None = None
        self._staged_layout: tuple[list[dict], str] | None = None
        self._staged_stats: dict[str, float] = {}
        self._staged: threading.Thread | None = None
        self._staged_outcome: dict[str, Any] = {}

    def plan(self) -> list[list]:
        """Names and shapes of the tensors, in send order (iterates them once)."""
        return make_plan((name, t.shape) for name, t in self.named_tensors())

    def listen(self, loopback: bool, timeout_s: float) -> tuple[str, int]:
        """Open the group's TCPStore on a free port, on 127.0.0.1 when `loopback` (every engine is on this node's
        loopback), else on this process's node address; returns (host, port). Replaces an earlier group."""
        import torch.distributed as dist

        self.close()
        host = "127.0.0.1" if loopback else _node_ip()
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        return host, int(self.store.port)

    def form(self, group: str, world: int, backend: str, timeout_s: float) -> None:
        """Join as rank 0; blocks until every engine worker joined (their join calls must be in flight)."""
        import torch.distributed as dist

        if self.store is None:
            raise TransportError("listen() before form()")
        prefix = dist.PrefixStore(group, self.store)
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefix, 0, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, 0, world, timeout)
        self.group = group

    def send(self, buckets: list[dict], dtype: str) -> dict[str, float]:
        if self.pg is None:
            raise TransportError("no weight group formed (connect first)")
        pg = self.pg
        device = "cuda" if self.device == "cuda" else "cpu"
        return pack_and_send(iter(self.named_tensors()), buckets, dtype, device, lambda flat: pg.broadcast(flat, 0),
                             self.buffers)  # fmt: skip

    def stage(self, buckets: list[dict], dtype: str, staging: str = "device") -> dict[str, float]:
        """async_training.sync_mode=background: copy the weights into the staging buffers (packed and cast as `send`
        packs them, where `staging` says: see `staging_buffers`; the next optimizer step does not touch them), then
        start their broadcast (`send_staged`) and return. The broadcast waits in the group for the engines, which
        join it when ParamSync's background thread asks them to receive (after its pause). The previous staged send
        must have finished: its failure is raised here (TransportError). Returns bytes, seconds spent packing and
        digesting, and the digest of the staged tensors (as `send`)."""
        import torch

        self.staged_result()
        if self.pg is None:
            raise TransportError("no weight group formed (connect first)")
        target = _torch_dtype(dtype)
        fits = (
            self._staging_kind == staging
            and len(self.staging) == len(buckets)
            and all(b.dtype == target and b.numel() == k["numel"] for b, k in zip(self.staging, buckets))
        )
        if not fits:
            self.staging = staging_buffers(buckets, dtype, staging, self.device)
            self._staging_kind = staging
        t0 = time.monotonic()
        it = iter(self.named_tensors())
        for bucket, flat in zip(buckets, self.staging):
            pack_bucket(it, bucket, flat)
        no_more_tensors(it)
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the copies are done before the optimizer may run
        t1 = time.monotonic()
        digest = _new_digest()
        for bucket, flat in zip(buckets, self.staging):
            digest_bucket(digest, bucket, flat)
        self._staged_layout = (buckets, dtype)
        self._staged_stats = {
            "bytes": float(sum(b.numel() * b.element_size() for b in self.staging)),
            "pack_s": t1 - t0,
            "digest": digest.hexdigest(),
            "digest_s": time.monotonic() - t1,
        }
        self.send_staged()
        return self._staged_stats

    def send_staged(self) -> None:
        """Start broadcasting the staged copy over the group formed last, in a thread of this process, and return.
        `stage` calls it; the transport calls it again after re-forming the group (an engine server restarted
        between the stage and the send): a broadcast still waiting in the old group is left to that group's timeout
        and its outcome dropped. `device` staging broadcasts the staging buffers as they are; `pinned` copies each
        bucket into the two send buffers on the sender's device first (nccl sends device memory only; on CPU the
        same code copies host to host)."""
        if self.pg is None:
            raise TransportError("no weight group formed (connect first)")
        if self._staged_layout is None:
            raise TransportError("nothing staged to send (stage first)")
        if self._staged is not None and self._staged.is_alive():
            self.buffers = []  # the abandoned send may still read the send buffers: this one packs into fresh ones
        pg, staging, stats, outcome = self.pg, list(self.staging), dict(self._staged_stats), {}
        buckets, dtype = self._staged_layout
        buffers, kind = self.buffers, self._staging_kind
        device = "cuda" if self.device == "cuda" else "cpu"

        def broadcast(flat: Any) -> Any:
            return pg.broadcast(flat, 0)

        def run() -> None:
            start = time.monotonic()
            try:
                if kind == "device":
                    for flat in staging:  # one at a time: engines load bucket k while k + 1 is on the wire
                        broadcast(flat).wait()
                else:
                    pack_and_send(staged_tensors(buckets, staging), buckets, dtype, device, broadcast, buffers)
                outcome["stats"] = {**stats, "wait_s": time.monotonic() - start}
            except BaseException as e:  # handed to the next stage() / staged_result()
                outcome["error"] = e

        self._staged_outcome = outcome
        self._staged = threading.Thread(target=run, name="weight-sender-staged", daemon=True)
        self._staged.start()

    def staged_result(self, timeout_s: float | None = None) -> dict[str, float] | None:
        """Wait for the staged send in flight (None when there is none); TransportError if it failed or is still
        running after `timeout_s`."""
        thread, self._staged = self._staged, None
        if thread is None:
            return None
        thread.join(timeout_s)
        if thread.is_alive():
            raise TransportError(f"the staged weight send did not finish within {timeout_s:g} s")
        if "error" in self._staged_outcome:
            e = self._staged_outcome["error"]
            raise TransportError(f"the staged weight send failed: {type(e).__name__}: {e}") from e
        return self._staged_outcome.get("stats")

    def close(self) -> None:
        # Dropping the objects closes the sockets; the engines drop theirs at fa_leave / the next fa_join.
        self.pg, self.store, self.group = None, None, None


# ---- the transport -----------------------------------------------------------------------------------------------


def _node_ip() -> str:
    """This process's node address as Ray knows it (what the engines on other nodes reach)."""
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    import socket

    return socket.gethostbyname(socket.gethostname())
