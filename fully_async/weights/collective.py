"""The collective transport: the trainer's sending rank broadcasts the weights straight into every engine worker.

One torch.distributed group, outside every default group: rank 0 is the sender (where the full weights are), ranks
1.. are the engine workers (world = 1 + the sum of the servers' tensor-parallel sizes). It rendezvous through a
TCPStore the sender opens (`PrefixStore` per group name); the backend is gloo on CPU and nccl on GPUs, chosen by
fully_async.device's device rule, and nothing else differs. The engine side is a vLLM worker extension
(fully_async/vllm_ext/fa_weight_receiver.py, run by the engine's own interpreter) reached through
`/collective_rpc` with JSON-string arguments; no pickle crosses the network.

A sync (ParamSync's phases after `pause`):
- `connect` (first sync, and again after the engine pool changed, e.g. a server restarted): the plan (names and
  shapes of the sender's tensors, once per transport) is checked against every engine's checkpoint headers, then
  the group is formed (the engines' join calls in flight while the sender forms its side).
- `send`: every engine gets the bucket layout (tensor names, shapes, offsets, the engine dtype) and starts
  receiving; the sender packs tensors in plan order into flat buckets of advanced.bucket_mb, cast to the
  engine dtype, the next bucket packed while the previous one is on the wire. Each engine loads bucket k while
  bucket k+1 is on the wire (the receiver streams; a send that fails midway leaves the engines with a mix of
  versions until the next sync, see the receiver). Both sides keep their bucket buffers from one sync to the next.
- `verify` (async_training.verify_sync): every engine's digest of the tensors it loaded equals the sender's of the
  tensors it packed (weights/verify.py); a server that differs or does not answer fails the sync, naming it.
- `set_version`: every engine resets its prefix cache and takes the version, no reload.
The group's per-operation timeout is a fraction of advanced.sync_timeout_s, so a dead or stalled peer fails
the send with an error naming the servers before ParamSync's watchdog would fire; if it does fire first, its
message names the servers that had not answered.

A server restarted between syncs comes back on its start-up weights: the engine pool keeps it out of rotation
(its slot is STALE, engines/slots.py) and bumps the epoch of its weights (engines/served.py); the next sync re-forms
the group and sends it the current version like every other server (weights already in memory on the trainer;
nothing is written to disk).

Background syncs (async_training.sync_mode=background): the trainer's next update waits only for `stage` (a reading
phase), a copy of the weights into one staging buffer per bucket (advanced.staging: `device`, a second copy on the
trainer's device, or `pinned`, pinned host memory copied through the two send buffers as it goes out; on CPU both
are host memory), whose broadcast starts at once; ParamSync's thread then runs `send` (the engines receive it) and `set_version`. A server
restarted between `stage` and `send` makes `send` re-form the group and broadcast the staged copy again.

`export` still writes safetensors (checkpoints and resume) through the backend.

This module is the driver's side (the transport ParamSync runs); the sender's side, in the process that holds the
weights, is weights/collective_sender.py; the engines' side is fully_async/vllm_ext/fa_weight_receiver.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fully_async.config.sections.advanced import STAGINGS
from fully_async.handles import resolve
from fully_async.weights.base import Phase, SyncPlan, WeightTransport
from fully_async.weights.collective_sender import (
    DTYPE_BYTES,
    GROUP_TIMEOUT_FRACTION,
    TransportError,
    layout_buckets,
    staging_bytes,
    staging_place,
)
from fully_async.weights.port import EnginePort
from fully_async.weights.verify import SyncVerifier

logger = logging.getLogger(__name__)


class CollectiveTransport(WeightTransport):
    """See the module docstring. `backend` must offer `weight_sender()` (an object with CollectiveSender's plan,
    listen, form, send and close, run where the full weights are) and `export_weights` (for `export`)."""

    name = "collective"

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
        """`rollouter`: the Rollouter's actor handle, asked through its engine port (weights/port.py). `verify`:
        async_training.verify_sync (a `verify` phase after `send`, weights/verify.py)."""
        if dtype not in DTYPE_BYTES:
            raise TransportError(f"engine dtype {dtype!r} cannot be sent collectively; one of {sorted(DTYPE_BYTES)}")
        if staging not in STAGINGS:
            from fully_async.config import ConfigError

            raise ConfigError(f"advanced.staging must be one of {list(STAGINGS)}, got {staging!r}")
        self.engines, self.backend, self.dtype = EnginePort(rollouter), backend, dtype
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
            ref = self.engines.rpc(server["index"], method, json.dumps(s), timeout_s)
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
        info = resolve(self.engines.layout())
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
        staging buffers, advanced.staging, whose broadcast starts at once and waits for the engines), then
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
        if resolve(self.engines.layout())["epoch"] == self._epoch:
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
                  f", kept for the run (advanced.staging={self.staging})", flush=True)  # fmt: skip
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
        resolve(self.engines.weights_received(version, self._epoch))

    def export(self, version: int) -> Path:
        out = self.root / f"v{version}"
        self.backend.export_weights(out, dtype=self.dtype, sync=True)
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
