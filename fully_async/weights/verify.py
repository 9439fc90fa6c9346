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
