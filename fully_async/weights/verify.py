"""The proof that a weight sync landed: every serving engine server reports the digest of what it loaded (a worker
extension method), and each one must equal the trainer side's digest.

A minimal stand-in with the interface the checksum work fixes (`verify_engines`); that work's module replaces it.
"""

from __future__ import annotations

import json
from typing import Any

from fully_async.handles import resolve

ANSWER_S = 30.0
"""How long one server may take to answer (the sync's watchdog bounds the phase as a whole)."""


def verify_engines(rollouter: Any, expected: str, method: str, spec: dict, what: str) -> dict[str, str]:
    """Ask every serving server of `rollouter` for `method(spec)` (each worker answers {"digest": ...}); returns
    {server URL: digest}. Raises ParamSyncError naming every server whose digest is not `expected` (or whose
    workers disagree) or that did not answer, and `what` (the payload, e.g. "adapter policy-v3")."""
    from fully_async.param_sync import ParamSyncError

    servers = resolve(rollouter.engine_layout.remote())["servers"]
    if not servers:
        raise ParamSyncError(f"{what}: no serving engine server to verify the sync on")
    refs = {s["url"]: rollouter.engine_rpc.remote(s["index"], method, json.dumps(spec), ANSWER_S) for s in servers}
    got: dict[str, str] = {}
    bad: list[str] = []
    for url, ref in refs.items():
        try:
            workers = resolve(ref)
        except Exception as e:  # every server is asked; each failure is named below
            bad.append(f"{url} did not answer ({type(e).__name__}: {e})")
            continue
        digests = sorted({str((w or {}).get("digest")) for w in workers})
        if digests == [expected]:
            got[url] = expected
        else:
            bad.append(f"{url} holds digest(s) {digests}")
    if bad:
        raise ParamSyncError(
            f"{what} did not land on {len(bad)} of {len(refs)} engine server(s) (expected digest {expected}): "
            + "; ".join(bad)
        )
    return got


class SyncVerifier:
    """A transport's verify phase: asks once whether the engines can report digests (a kind without the worker
    extension cannot: one line says so and syncs go unverified), then verifies each sync (`__call__`)."""

    def __init__(self, rollouter: Any, enabled: bool = True) -> None:
        self.rollouter = rollouter
        self.enabled = enabled
        self._checked = False

    def active(self) -> bool:
        """Whether syncs are verified (asks the engines' kind once; a rollouter that cannot say is taken to have
        engines that can)."""
        if self.enabled and not self._checked:
            self._checked = True
            try:
                why = resolve(self.rollouter.engine_unverifiable.remote())
            except AttributeError:
                why = ""
            if why:
                self.enabled = False
                print(f"fully_async: weight syncs are not verified by a digest: {why}", flush=True)
        return self.enabled

    def __call__(self, expected: Any, method: str, what: str, spec: dict | None = None) -> dict[str, str]:
        """Verify one sync: `expected` is the trainer side's digest, or a function computing it."""
        expected = expected() if callable(expected) else expected
        return verify_engines(self.rollouter, expected, method, spec or {}, what)
