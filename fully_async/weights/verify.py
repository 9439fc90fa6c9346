"""The proof that a weight sync landed: every serving engine server reports the digest of what it loaded, and each one
must equal the trainer side's digest of what it wrote or sent.

The digest is fully_async/vllm_ext/fa_digest.py's (a sampled, order-independent checksum of names, shapes,
dtypes and values). The engine side computes it in its worker extension on the tensors it hands to vLLM's loader
(fa_reload for the disk transport, fa_receive for the collective one; fa_adapter_digest for LoRA adapters) and
answers it to a later call (`method`). A server whose digest differs, or that does not answer within
engine.control_deadline_s, fails the sync with a ParamSyncError naming it and the payload: the silent failure this
guards against is an engine that keeps sampling old weights while every metric looks like staleness.

What it proves: each worker of each server took, through its loader, exactly the tensors the trainer wrote or sent
(up to the sampling: a change between two sampled elements of a tensor can go unseen). What it cannot: what vLLM
does with them after the loader (sharding for tensor parallelism, the CPU kernels' repacking), which no checksum
of the served parameters can compare with the trainer's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fully_async.handles import resolve
from fully_async.weights.base import ParamSyncError
from fully_async.weights.port import EnginePort

logger = logging.getLogger(__name__)

VERIFIED_METRIC = "fully_async/param_sync/verified_servers"
"""Servers whose digest matched at a sync (docs/metrics.md)."""


def verify_engines(rollouter: Any, expected: str, method: str, spec: dict, what: str) -> dict[str, str]:
    """Ask every serving server of `rollouter` (an actor handle, asked through its engine port, weights/port.py) for
    `method(spec)` (the worker extension's digest of the payload it loaded last) in one pool-wide fan-out under
    engine.control_deadline_s; returns {server URL: digest}. Raises ParamSyncError naming every server whose digest
    is not `expected` (or whose workers disagree) or that did not answer, and `what` (the payload: "weights v3",
    "adapter policy-v3"); also when the engine kind cannot report a digest at all (never a silent pass)."""
    return check_answers(rollouter, ask_engines(rollouter, method, spec), expected, what)


def ask_engines(rollouter: Any, method: str, spec: dict) -> dict[str, Any] | None:
    """The pool-wide fan-out of `verify_engines`: {url: the workers' answers, or why none}; None when the engine kind
    has no worker extension to ask."""
    return resolve(EnginePort(rollouter).rpc_all(method, json.dumps(spec)))


def check_answers(rollouter: Any, answers: dict[str, Any] | None, expected: str, what: str) -> dict[str, str]:
    """`verify_engines`' judgement of the answers `ask_engines` collected (see there)."""
    if answers is None:
        why = resolve(EnginePort(rollouter).unverifiable())
        raise ParamSyncError(f"{what}: cannot verify the sync: {why}")
    if not answers:
        # Every server was set aside during this sync (its node lost, or it stopped answering): nothing serves, so
        # nothing serves unproven weights; one that comes back is brought to the current version before it serves.
        logger.warning("%s: no serving engine server to verify the sync on (all set aside); nothing to prove", what)
        return {}
    got: dict[str, str] = {}
    bad: list[str] = []
    for url, workers in answers.items():
        if isinstance(workers, str):
            bad.append(f"{url} did not answer ({workers})")
            continue
        digests = sorted({str((w or {}).get("digest")) for w in workers})
        if digests == [expected]:
            got[url] = expected
            continue
        if len(digests) > 1:
            bad.append(f"{url}'s workers disagree: {digests}")
            continue
        source = (workers[0] or {}).get("source") if workers else None
        bad.append(f"{url} loaded digest {digests[0] if digests else None} (from {source})")
    if bad:
        raise ParamSyncError(
            f"{what} did not land on {len(bad)} of {len(answers)} engine server(s) (expected digest {expected}): "
            + "; ".join(bad)
        )
    return got


class SyncVerifier:
    """A transport's `verify` phase: checks, once, whether the engines can report digests (engine=sim and SGLang
    cannot: one line says so and verification is skipped for the run), then verifies each sync. `enabled` False
    (async_training.verify_sync=false) skips it without asking."""

    def __init__(self, rollouter: Any, enabled: bool = True) -> None:
        self.rollouter = rollouter
        self.enabled = enabled
        self._checked = False
        self.last_s: dict[str, float] = {}
        """Seconds of the last verification: `trainer_digest_s` (the trainer side's digest, when computed here),
        `engines_s` (the fan-out, the engines' answers included), `engine_digest_s` (the slowest engine worker's
        digest of its load, taken while it loaded)."""

    def active(self) -> bool:
        """Whether syncs are verified (asks the engines' kind once)."""
        if self.enabled and not self._checked:
            self._checked = True
            why = resolve(EnginePort(self.rollouter).unverifiable())
            if why:
                self.enabled = False
                print(f"fully_async: weight syncs are not verified by a digest: {why}", flush=True)
        return self.enabled

    def __call__(
        self, expected: Any, method: str, what: str, spec: dict | None = None, answers: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """Verify one sync: `expected` is the trainer side's digest, or a function computing it (timed apart).
        `answers`: the servers' digests already in hand ({url: the workers' answers}, the disk transport's reload
        answers them), else asked for with `method(spec)`."""
        t0 = time.monotonic()
        expected = expected() if callable(expected) else expected
        t1 = time.monotonic()
        if answers is None:
            answers = ask_engines(self.rollouter, method, spec or {})
        self.last_s = {"trainer_digest_s": t1 - t0, "engines_s": time.monotonic() - t1}
        workers = [w for a in (answers or {}).values() if isinstance(a, list) for w in a if isinstance(w, dict)]
        self.last_s["engine_digest_s"] = max((float(w.get("digest_s") or 0.0) for w in workers), default=0.0)
        return check_answers(self.rollouter, answers, expected, what)
