"""The collective transport: the trainer's sending rank broadcasts the weights straight into every engine worker.

One torch.distributed group, outside every default group: rank 0 is the sender (where the full weights are), ranks
1.. are the engine workers (world = 1 + the sum of the servers' tensor-parallel sizes). It rendezvous through a
TCPStore the sender opens (`PrefixStore` per group name); the backend is gloo on CPU and nccl on GPUs, chosen by
fully_async.host's device rule, and nothing else differs. The engine side is a vLLM worker extension
(fully_async/vllm_ext/fa_weight_receiver.py, run by the engine's own interpreter) reached through
`/collective_rpc` with JSON-string arguments; no pickle crosses the network.

A sync (ParamSync's phases after `pause`):
- `connect` (first sync, and again after the engine pool changed, e.g. a server restarted): the plan (names and
  shapes of the sender's tensors, once per transport) is checked against every engine's checkpoint headers, then
  the group is formed (the engines' join calls in flight while the sender forms its side).
- `send`: every engine gets the bucket layout (tensor names, shapes, offsets, the engine dtype) and starts
  receiving; the sender packs tensors in plan order into flat buckets of async_training.bucket_mb, cast to the
  engine dtype, the next bucket packed while the previous one is on the wire. Each engine loads bucket k while
  bucket k+1 is on the wire (the receiver streams; a send that fails midway leaves the engines with a mix of
  versions until the next sync, see the receiver). Both sides keep their bucket buffers from one sync to the next.
- `verify` (async_training.verify_sync): every engine's digest of the tensors it loaded equals the sender's of the
  tensors it packed (weights/verify.py); a server that differs or does not answer fails the sync, naming it.
- `set_version`: every engine resets its prefix cache and takes the version, no reload.
The group's per-operation timeout is a fraction of async_training.sync_timeout_s, so a dead or stalled peer fails
the send with an error naming the servers before ParamSync's watchdog would fire; if it does fire first, its
message names the servers that had not answered.

A server restarted between syncs comes back on its start-up weights: the engine pool keeps it out of rotation
(its slot is STALE, engines/slots.py) and bumps its epoch; the next sync re-forms the group and sends it the current version like
every other server (weights already in memory on the trainer; nothing is written to disk).

Background syncs (async_training.sync_mode=background): the trainer's thread runs only `stage`, a copy of the weights
into one staging buffer per bucket (async_training.staging: `device`, a second copy on the trainer's device, or
`pinned`, pinned host memory copied through the two send buffers as it goes out; on CPU both are host memory), whose
broadcast starts at once; ParamSync's thread then runs `send` (the engines receive it) and `set_version`. A server
restarted between `stage` and `send` makes `send` re-form the group and broadcast the staged copy again.

`export` still writes safetensors (checkpoints and resume) through the backend.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from fully_async.config.sections.async_training import STAGINGS
from fully_async.handles import resolve
from fully_async.weights.base import Phase, SyncPlan, WeightTransport
from fully_async.weights.verify import SyncVerifier

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Engine dtypes the transport sends in, with their element sizes."""

GROUP_TIMEOUT_FRACTION = 0.5
"""The group's per-operation timeout as a share of async_training.sync_timeout_s: a peer that stops answering fails
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
    """One flat buffer per bucket for a background sync's copy of the weights (async_training.staging): `device`: on
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
    iterator of (checkpoint name, full tensor) in a fixed order each call; `device`: where they live (cpu | cuda)."""

    def __init__(self, named_tensors: Callable[[], Iterable[tuple[str, Any]]], device: str = "cpu") -> None:
        _new_digest()  # its import (fully_async.engines, ~0.7 s here) at the transport's set-up, not in a send
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
class CollectiveTransport(WeightTransport):
    """See the module docstring. `backend` must offer `weight_sender()` (an object with CollectiveSender's plan,
    listen, form, send and close, run where the full weights are) and `export_weights` (for `export`)."""

    name = "collective"
    engine_receiver = True

    def __init__(
        self,
        rollouter: Any,
        backend: Any,
        weights_root: str | Path,
        dtype: str,
        *,
        bucket_mb: float = 16,
        sync_timeout_s: float = 300.0,
        device: str = "cpu",
        verify: bool = True,
        staging: str = "device",
    ) -> None:
        """`verify`: async_training.verify_sync (a `verify` phase after `send`, weights/verify.py)."""
        if dtype not in DTYPE_BYTES:
            raise TransportError(f"engine dtype {dtype!r} cannot be sent collectively; one of {sorted(DTYPE_BYTES)}")
        if staging not in STAGINGS:
            from fully_async.config import ConfigError

            raise ConfigError(f"async_training.staging must be one of {list(STAGINGS)}, got {staging!r}")
        self.rollouter, self.backend, self.dtype = rollouter, backend, dtype
        self.device, self.staging = device, staging
        self.root = Path(weights_root)
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.group_timeout_s = max(1.0, sync_timeout_s * GROUP_TIMEOUT_FRACTION)
        self.backend_name = "nccl" if device == "cuda" else "gloo"
        self.sender = backend.weight_sender()
        self._plan: list[list] | None = None
        self._epoch: int | None = None
        self._servers: list[dict] = []
        self._pending: dict[str, Any] = {}
        """url -> the Ray ref of that server's call in flight (for the watchdog's message)."""
        self.last: dict[str, Any] = {}
        """What the last send reported: sender stats and each engine worker's answer."""
        self.members: dict[str, list] = {}
        """Server URL -> its workers' answers to joining the group formed last (rank, pid)."""
        self._staging_shown = False
        self._staged_stats: dict[str, float] = {}
        self.verifier = SyncVerifier(rollouter, verify)

    # -- engine calls -----------------------------------------------------------------------------------------------
    def _rpc_all(self, method: str, spec: dict | list[dict], timeout_s: float) -> list:
        """Fire `method` on every server (spec per server, or one for all); returns the refs, recorded as pending."""
        specs = spec if isinstance(spec, list) else [spec] * len(self._servers)
        refs = []
        self._pending = {}
        for server, s in zip(self._servers, specs):
            ref = self.rollouter.engine_rpc.remote(server["index"], method, json.dumps(s), timeout_s)
            self._pending[server["url"]] = ref
            refs.append(ref)
        return refs

    def _collect(self, what: str, refs: list, timeout_s: float) -> list:
        """Answers of every server's call; TransportError naming each failed or silent server otherwise."""
        waiting = set(_wait(refs, timeout_s))
        answers, failed = [], []
        for server, ref in zip(self._servers, refs):
            if ref in waiting:
                failed.append(f"{server['url']}: no answer within {timeout_s:g} s")
                continue
            try:
                answers.append(resolve(ref))
            except Exception as e:  # noqa: BLE001 - collected per server, raised below naming each
                cause = getattr(e, "cause", None) or e
                failed.append(f"{server['url']}: {cause}")
        if failed:
            raise TransportError(f"{what} failed on {len(failed)} of {len(refs)} engine servers: " + "; ".join(failed))
        self._pending = {}
        return answers

    def pending(self) -> str:
        """Servers whose call of the running phase has not answered (for the watchdog's message)."""
        pending = dict(self._pending)
        if not pending:
            return ""
        waiting = set(_wait(list(pending.values()), 0))
        silent = [url for url, ref in pending.items() if ref in waiting]
        return f"engine servers not answering: {', '.join(silent)}" if silent else ""

    # -- phases -----------------------------------------------------------------------------------------------------
    def prepare(self, rollouter: Any) -> None:
        self._connect()

    def _connect(self) -> None:
        """Check the plan against every engine, then (re-)form the group with the pool as it is now."""
        info = resolve(self.rollouter.engine_layout.remote())
        self._servers = info["servers"]
        if self._plan is None:
            self._plan = self.sender.plan()
        self._collect("weight plan check", self._rpc_all("fa_check", {"tensors": self._plan},
                                                          self.group_timeout_s), self.group_timeout_s)  # fmt: skip
        if self._epoch is not None:  # a re-form: survivors drop the old group first
            self._collect("leaving the old weight group", self._rpc_all("fa_leave", {}, 30.0), 60.0)
        # The store lives in the sender's process (the trainer's rank 0, possibly on another node than this one).
        host, port = self.sender.listen(all(_is_loopback(s["url"]) for s in self._servers), self.group_timeout_s)
        group = f"fa-weights-{uuid.uuid4().hex[:8]}"
        world = 1 + sum(int(s["workers"]) for s in self._servers)
        specs, offset = [], 1
        for s in self._servers:
            specs.append({"host": host, "port": port, "world": world, "rank_offset": offset, "group": group,
                          "backend": self.backend_name, "timeout_s": self.group_timeout_s})  # fmt: skip
            offset += int(s["workers"])
        refs = self._rpc_all("fa_join", specs, self.group_timeout_s)
        try:
            self.sender.form(group, world, self.backend_name, self.group_timeout_s)
        except Exception as e:
            self._collect_quietly(refs)
            raise TransportError(f"forming the weight group (world {world}) failed: {e}") from e
        joined = self._collect("joining the weight group", refs, self.group_timeout_s + 30)
        self.members = {s["url"]: answer for s, answer in zip(self._servers, joined)}
        self._group, self._epoch = group, info["epoch"]
        logger.info("weight group %s formed: world %d, backend %s, servers %s", group, world, self.backend_name,
                    [s["url"] for s in self._servers])  # fmt: skip

    def _collect_quietly(self, refs: list) -> None:
        _wait(refs, self.group_timeout_s + 30)

    def plan(self, version: int, background: bool) -> SyncPlan:
        """Blocking: `send` (the engines receive the weights the backend holds now), `verify`, `set_version`, all
        while the engines are paused. Background: `stage` (the trainer's: a copy of the weights into the sender's
        staging buffers, async_training.staging, whose broadcast starts at once and waits for the engines), then
        `send` (the engines receive the staged version), `verify`, `set_version`. A server restarted between stage
        and send: `send` re-forms the group with the pool as it is and broadcasts the staged copy again into the
        new one, as blocking mode's `send` re-forms it."""
        last = (*self._verify_phase(version), ("set_version", lambda: self._set_version(version)))
        if background:
            return SyncPlan(reads=(("stage", self._stage),), engines=(("send", self._send_staged), *last))
        return SyncPlan(engines=(("send", lambda: self._send()), *last))

    def _verify_phase(self, version: int) -> list[Phase]:
        """Every server's digest of what it received equals the sender's of what it packed (before the version is
        set: unproven weights are never labelled)."""
        if not self.verifier.active():
            return []
        return [
            ("verify", lambda: self.verifier(self.last["sender"]["digest"], "fa_loaded_digest", f"weights v{version}"))
        ]

    def _buckets(self) -> list[dict]:
        return layout_buckets(self._plan, self.dtype, self.bucket_bytes)

    def _reconnect_if_changed(self) -> bool:
        """Re-form the group when the pool changed (a server restarted) since it was formed; True when it did."""
        if resolve(self.rollouter.engine_layout.remote())["epoch"] == self._epoch:
            return False
        self._connect()
        return True

    def _stage(self) -> None:
        # No re-form here, even when the pool changed since the last sync: the staged broadcast then goes to the old
        # group and `send` re-forms it in ParamSync's thread, so the trainer never waits for a group to form.
        if not self._staging_shown:
            size = staging_bytes(self._plan, self.dtype)
            print(f"fully_async: background weight sync: the collective transport stages a copy of the weights, "
                  f"{size / (1 << 20):.1f} MiB ({size} bytes, {self.dtype}) in {staging_place(self.staging, self.device)}"
                  f", kept for the run (async_training.staging={self.staging})", flush=True)  # fmt: skip
            self._staging_shown = True
        self._staged_stats = self.sender.stage(self._buckets(), self.dtype, self.staging)

    def _send_staged(self) -> None:
        try:
            if self._reconnect_if_changed():  # the staged broadcast went to the old group: send it into the new one
                logger.warning("the engine pool changed between staging and sending the weights: group re-formed, "
                               "staged copy sent again")  # fmt: skip
                self.sender.send_staged()
            spec = {"group": self._group, "dtype": self.dtype, "buckets": self._buckets(),
                    "timeout_s": self.group_timeout_s}  # fmt: skip
            answers = self._collect("receiving weights", self._rpc_all("fa_receive", spec, self.group_timeout_s * 2),
                                    self.group_timeout_s * 2 + 30)  # fmt: skip
        except BaseException:
            self._epoch = None  # the group is in an unknown state: re-form it at the next sync
            raise
        self.last = {"sender": self._staged_stats, "engines": answers}

    def _send(self) -> None:
        self._reconnect_if_changed()
        buckets = self._buckets()
        spec = {"group": self._group, "dtype": self.dtype, "buckets": buckets, "timeout_s": self.group_timeout_s}
        refs = self._rpc_all("fa_receive", spec, self.group_timeout_s * 2)
        # The sender runs in a thread of its own so that an engine failing first (its receive timed out, its process
        # died) fails the phase at once, naming it, even while the sender is stuck (a stalled trainer).
        sending: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                sending.set_result(self.sender.send(buckets, self.dtype))
            except BaseException as e:  # handed to the phase below
                sending.set_exception(e)

        threading.Thread(target=run, name="weight-sender", daemon=True).start()
        deadline = time.monotonic() + self.group_timeout_s * 2 + 30
        try:
            while not sending.done():
                failed = [ref for ref in refs if ref not in set(_wait(refs, 0))]
                for ref in failed:
                    try:
                        resolve(ref)
                    except Exception:  # noqa: BLE001 - an engine failed while the sender still runs
                        self._collect("receiving weights", refs, self.group_timeout_s * 2 + 30)
                if time.monotonic() > deadline:
                    raise TransportError(f"the sender did not finish within {self.group_timeout_s * 2 + 30:g} s")
                concurrent.futures.wait([sending], timeout=0.1)
            try:
                stats = sending.result()
            except Exception as e:
                # The engines fail their receive at the group timeout (with what arrived loaded); name them.
                try:
                    self._collect("receiving weights", refs, self.group_timeout_s + 30)
                except TransportError as engines:
                    raise TransportError(f"sending weights failed ({e}); {engines}") from e
                raise TransportError(f"sending weights failed: {e}") from e
            answers = self._collect("receiving weights", refs, self.group_timeout_s * 2 + 30)
        except BaseException:
            self._epoch = None  # the group is in an unknown state: re-form it at the next sync
            raise
        self.last = {"sender": stats, "engines": answers}

    def _set_version(self, version: int) -> None:
        resolve(self.rollouter.weights_received.remote(version, self._epoch))

    def export(self, version: int) -> Path:
        out = self.root / f"v{version}"
        self.backend.export_weights(out, dtype=self.dtype)
        return out

    def close(self, remove: bool = True) -> None:
        self.sender.close()
        if remove and self.root.name.startswith("fully_async-weights-"):
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)


def _is_loopback(url: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _node_ip() -> str:
    """This process's node address as Ray knows it (what the engines on other nodes reach)."""
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    import socket

    return socket.gethostbyname(socket.gethostname())


def _wait(refs: list, timeout_s: float) -> list:
    """Wait until every ref (Ray ObjectRef or LocalActor future) is done or `timeout_s` passed; the ones not done."""
    import concurrent.futures

    futures = [r for r in refs if isinstance(r, concurrent.futures.Future)]
    if len(futures) == len(refs):
        _, waiting = concurrent.futures.wait(futures, timeout=timeout_s)
        return [r for r in refs if r in waiting]
    import ray

    _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return list(waiting)
