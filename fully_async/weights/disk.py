"""The disk transport: the backend exports safetensors into `root/v<version>`, every engine server reloads a directory
holding that version (one control call per server, through the rollouter, which also labels the version).

The root is under /dev/shm when it exists (`default_weights_root`), so "disk" is memory bandwidth on one node.

Several nodes: a server whose Ray node is not the trainer's (the process running ParamSync, which reads the export)
is taken not to see its files. Phase `distribute` then puts the version's files into Ray's object store, in chunks,
once; one engine host per such node (the first server's) takes them and writes them under a node-local root
(`node_root`: /dev/shm/<name> on that node), however many servers the node has; the reload points each server at
its node's copy. On one node `distribute` copies nothing. The rule is by node id, not by probing the filesystem, so a
root on a shared filesystem is copied too (a byte-for-byte copy into memory is cheap next to the reload; the object
store is the one path that works everywhere).

A node that stops answering (a hung node) costs a sync about engine.control_deadline_s, not Ray's minute to declare it
dead: while a node's copy runs, its engine host is asked every PROBE_EVERY_S whether it lives; a host that does not
answer within the deadline has its copy abandoned for this sync, and the reload sets that node's servers aside
(engines/control.py: down, then restarted or replaced). A node Ray already reports dead gets no copy at all.

Proof: phase `verify` (async_training.verify_sync) takes the digest of the version's files (`files_digest`: the one
the export recorded while writing, else a sampled read of the files) and requires every serving server's digest of
the tensors its loader took (fa_reload) to equal it (weights/verify.py).

Versions: each root keeps the version just written and the one before, so a server restarted meanwhile still finds
the weights it was told about (the engine pool reloads a restarted server from its node's directory); older ones are
removed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fully_async.handles import dead_nodes, one_line, resolve
from fully_async.weights.base import Phase, SyncPlan, WeightTransport, export_plan
from fully_async.weights.port import EnginePort
from fully_async.weights.verify import SyncVerifier

log = logging.getLogger(__name__)

ROOT_PREFIX = "fully_async-weights-"
"""Name prefix of a root this transport created itself (and removes on close), and of every node-local root."""

CHUNK_BYTES = 64 << 20
"""Files go into Ray's object store in pieces of at most this many bytes: the sending process never holds more than
one piece of a file beyond what the store holds, and a node's writer streams them to disk."""

STALL_LOG_S = 30.0
"""While copies are outstanding, the nodes not done yet are logged this often (ParamSync's timeout bounds the wait)."""

ABANDONED_WAIT_S = 10.0
"""At close, how long a copy abandoned in a sync may still run (its node came back) before the node roots are
removed."""

PROBE_EVERY_S = 1.0
"""While a node's copy runs, its engine host is asked whether it lives this often (an answer within
engine.control_deadline_s keeps the copy; none abandons it)."""


def default_weights_root(run_dir: str | Path) -> Path:
    """A fresh directory under /dev/shm when it exists (memory speed), else RUN_DIR/weights."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        return Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir=shm))
    return Path(run_dir) / "weights"


ROOT_RECORD = ".weights_root"
"""The file in a run directory that names the weights root of the run that used it last (`claim_weights_root`)."""


def claim_weights_root(run_dir: str | Path, root: Path) -> Path | None:
    """Record `root` as the weights root of the run in `run_dir`, after removing the root the previous run of that
    directory recorded, if it is still there: a run killed with SIGKILL (or a lost machine's process) cannot remove
    its own /dev/shm root, and its resume is the next process that knows it. Only a directory named like a root
    (ROOT_PREFIX) straight under /dev/shm is removed. Returns the removed root, or None."""
    record = Path(run_dir) / ROOT_RECORD
    removed = None
    try:
        old = Path(record.read_text().strip())
    except (FileNotFoundError, ValueError):
        old = None
    ours = old is not None and old != root and old.parent == Path("/dev/shm") and old.name.startswith(ROOT_PREFIX)
    if ours and old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
        removed = old
        log.info("weights: removed %s, left by the previous run of %s", old, run_dir)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(f"{root}\n")
    return removed


def node_root(name: str) -> Path:
    """Where a node-local root called `name` lives on the calling process's node: /dev/shm when it exists (memory),
    else the system's temporary directory."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / name


NODE_INFIX = "-node-"
"""Between a run's tag and a node id (its first 12 hex digits) in a node-local root's name."""


def node_roots_of_run(name: str) -> list[Path]:
    """Every node-local root on this machine of the run whose roots are named like `name` (same run tag), `name`'s
    own included: on one machine (a loopback cluster, or a raylet restarted under a new node id) several nodes' roots
    of one run sit side by side."""
    run = name.rsplit(NODE_INFIX, 1)[0] + NODE_INFIX
    return sorted(node_root(name).parent.glob(run + "*"))


def remove_dead_node_roots(name: str, alive_node_ids: set[str]) -> list[Path]:
    """Delete the roots of this run (see `node_roots_of_run`) on this machine whose node is not among
    `alive_node_ids`: a node lost on this machine left its copy behind, and nothing else will remove it. Returns
    them. A root of another run, or of a live node, is never touched."""
    removed = []
    for root in node_roots_of_run(name):
        node = root.name.rsplit(NODE_INFIX, 1)[1]
        if root.name != name and not any(alive.startswith(node) for alive in alive_node_ids):
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
    if removed:
        log.warning("weights: removed %d copy(ies) this run left for lost nodes: %s", len(removed),
                    [r.name for r in removed])  # fmt: skip
    return removed


def write_node_copy(name: str, version: int, files: list[tuple[str, list[Any]]], get: Callable[[Any], Any]) -> Path:
    """Write one version's files into `node_root(name)/v<version>` and return that directory. `files`: (path
    relative to the version's directory, chunks in order), each chunk turned into bytes-like data by `get` (ray.get
    of an object-store reference on an engine host). The directory appears whole or not at all (written beside it,
    then renamed); the previous version stays, older ones are removed."""
    root = node_root(name)
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"v{version}"
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=root))
    try:
        for rel, chunks in files:
            path = tmp / rel
            if tmp.resolve() not in path.resolve().parents:
                raise ValueError(f"weight file {rel!r} is outside the version's directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                for chunk in chunks:
                    f.write(memoryview(get(chunk)).cast("B"))
        if out.exists():  # the same version again (a retried sync): the new bytes win
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep={out.name, f"v{version - 1}"})
    return out


def prune(root: Path, keep: set[str]) -> None:
    """Remove every version directory (v*) under `root` not named in `keep`."""
    for old in root.glob("v*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def file_chunks(directory: Path, put: Callable[[Any], Any], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[str, list]]:
    """Every regular file under `directory` as (relative path, [put(uint8 array) per chunk of at most
    `chunk_bytes`]), in a stable order. An empty file has no chunks."""
    import numpy as np

    out = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        chunks = []
        with open(path, "rb") as f:
            while piece := f.read(chunk_bytes):
                chunks.append(put(np.frombuffer(piece, dtype=np.uint8)))
        out.append((str(path.relative_to(directory)), chunks))
    return out


def copy_plan(servers: list[dict[str, Any]], here: str | None) -> dict[str, dict[str, Any]]:
    """The nodes that need a copy, from the engine servers' placement (the engine port's `nodes`: per server
    {"node_id", "node_ip", "host"}) and `here`, the node that reads the export: {node_id: the first server's entry on
    that node (its host writes the node's copy)}. A server without a node id (a child of an actor outside Ray) or on
    `here` needs none. A server elsewhere without a host cannot be written to: ValueError naming it."""
    plan: dict[str, dict[str, Any]] = {}
    for index, server in enumerate(servers):
        node = server.get("node_id")
        if node is None or node == here or node in plan:
            continue
        if server.get("host") is None:
            raise ValueError(
                f"engine server {index} runs on node {server.get('node_ip')} ({node}), not the trainer's, and has no "
                "engine host to write the weights there"
            )
        plan[node] = server
    return plan


class DiskTransport(WeightTransport):
    name = "disk"
    # Writing the version's directory needs no engine: the engines are held from `distribute` on. (The copy to other
    # nodes needs none either, but it stays inside the pause: a hung node costs the pause its deadline and is set
    # aside there, so the copy then skips it; copied first, a hung node would cost a sync the deadline twice.)

    def __init__(self, rollouter: Any, backend: Any, root: str | Path, dtype: str, verify: bool = True) -> None:
        """`rollouter`: the Rollouter's actor handle, asked through its engine port (weights/port.py). `verify`:
        async_training.verify_sync (a `verify` phase after `reload`, weights/verify.py)."""
        self.engines, self.backend, self.dtype = EnginePort(rollouter), backend, dtype
        self.verifier = SyncVerifier(rollouter, verify)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.run_tag = uuid.uuid4().hex[:8]
        """Names this run's node-local roots (several runs may share a node)."""
        self.node_dirs: dict[str, str] = {}
        """node id -> that node's copy of the version distributed last (empty on one node)."""
        self.writers: dict[str, Any] = {}
        """node id -> the engine host that wrote a copy there (close() asks it to remove the root)."""
        self.deadline_s: float | None = None
        """engine.control_deadline_s, asked of the rollouter at the first copy to another node."""
        self.abandoned: list[Any] = []
        """Copies abandoned because their node stopped answering (close() lets a node that came back finish first)."""

    def node_root_name(self, node_id: str) -> str:
        return f"{ROOT_PREFIX}{self.run_tag}{NODE_INFIX}{node_id[:12]}"

    def prepare(self, rollouter: Any) -> None:
        """Nothing to set up: which nodes need a copy is decided at every sync (servers may move between syncs)."""

    def plan(self, version: int, background: bool) -> SyncPlan:
        """The backend's export phases into the version's own directory (new at every version: the engines still
        serving the previous one never see a half-written file; `export_plan`: one `export`, or with the verl backend
        an `export` that only queues the ranks' copy and a `write` ahead of the pause), then distribute, reload and
        verify, which read only that directory, not the backend. The same plan in both modes."""
        out = self.root / f"v{version}"
        reloaded: dict = {}

        def reload() -> None:
            # vLLM's workers answer the reload with their digests of what the loader took: the proof needs no
            # other round trip (an engine that answers none, a fake's older protocol, is asked in `verify`).
            answers = resolve(self.engines.load_weights(str(out), version, self.node_dirs or None))
            if answers and all(isinstance(a, list) and a and "digest" in (a[0] or {}) for a in answers.values()):
                reloaded["answers"] = answers
            prune(self.root, keep={out.name, f"v{version - 1}"})

        engines: list[Phase] = [("distribute", lambda: self.distribute(version)), ("reload", reload)]
        if self.verifier.active():  # every server's digest of what its loader took equals that of the files
            engines.append(("verify", lambda: self.verifier(lambda: files_digest(out), "fa_loaded_digest",
                                                             f"weights v{version}",
                                                             answers=reloaded.get("answers"))))  # fmt: skip
        return dataclasses.replace(export_plan(self.backend, out, self.dtype), engines=tuple(engines))

    def export(self, version: int) -> Path:
        out = self.root / f"v{version}"
        self.backend.export_weights(out, dtype=self.dtype, sync=True)
        return out

    def distribute(self, version: int) -> dict[str, str | None]:
        """Copy `root/v<version>` to every engine node other than this one (see the module docstring); returns and
        remembers {node id: node-local directory} for the reload, None for a node that got no copy this time (Ray
        reports it dead, its host died, or it stopped answering: the reload sets its servers aside). A node whose
        copy fails otherwise raises RuntimeError naming it."""
        servers = resolve(self.engines.nodes())
        plan = copy_plan(servers, _this_node())
        if not plan:
            self.node_dirs = {}
            return {}
        import ray

        if self.deadline_s is None:
            self.deadline_s = float(resolve(self.engines.control_deadline_s()))
        lost = dead_nodes() & set(plan)
        for node in lost:
            log.warning("weights v%d: node %s is dead in Ray; no copy, its servers are set aside", version,
                        _node_label(plan[node]))  # fmt: skip
        files = file_chunks(self.root / f"v{version}", ray.put)
        pending = {}
        for node, server in plan.items():
            if node not in lost:
                self.writers[node] = server["host"]
                pending[server["host"].write_weights.remote(self.node_root_name(node), version, files)] = node
        done: dict[str, str | None] = dict.fromkeys(lost)
        done.update(self._await_copies(version, plan, pending))
        self.node_dirs = done
        return done

    def _await_copies(self, version: int, plan: dict[str, dict[str, Any]], pending: dict[Any, str]):
        """{node: its copy's directory, or None} for the copies `pending` ({ObjectRef: node}). While a copy runs its
        node's engine host is probed (a cheap actor call, answered beside the copy); a node whose probe is not answered
        within `deadline_s` has stopped (a hung node): its copy is abandoned for this sync instead of waiting for Ray
        to declare the node dead. A live node's copy is waited for (ParamSync's timeout bounds it)."""
        import ray

        out: dict[str, str | None] = {}
        probes: dict[Any, str] = {}
        sent: dict[str, float] = {}
        due: dict[str, float] = {node: 0.0 for node in pending.values()}
        last_log = time.monotonic()
        while pending:
            now = time.monotonic()
            for node, at in list(due.items()):
                if at <= now:
                    probes[plan[node]["host"].where.remote()] = node
                    sent[node] = now
                    del due[node]
            ready, _ = ray.wait([*pending, *probes], num_returns=1, timeout=PROBE_EVERY_S)
            for ref in ready:
                if ref in probes:  # answered (or failed: the copy's own result says why): probe again later
                    node = probes.pop(ref)
                    if node in pending.values():
                        due[node] = time.monotonic() + PROBE_EVERY_S
                    continue
                node = pending.pop(ref)
                due.pop(node, None)
                out[node] = self._copy_result(version, plan[node], ref)
            now = time.monotonic()
            for ref, node in list(probes.items()):
                if node in pending.values() and now - sent[node] > self.deadline_s:
                    del probes[ref]
                    self.abandoned += [r for r, n in pending.items() if n == node]
                    pending = {r: n for r, n in pending.items() if n != node}
                    out[node] = None
                    log.warning("weights v%d: node %s did not answer within engine.control_deadline_s=%gs during the "
                                "copy; abandoned for this sync, its servers are set aside", version,
                                _node_label(plan[node]), self.deadline_s)  # fmt: skip
            if pending and now - last_log > STALL_LOG_S:
                last_log = now
                waiting = ", ".join(_node_label(plan[n]) for n in pending.values())
                log.warning("weights v%d: still copying to node(s) %s", version, waiting)
        return out

    def _copy_result(self, version: int, server: dict[str, Any], ref: Any) -> str | None:
        """The directory a finished copy wrote; None when its host died (its node lost)."""
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            # The writing host died (its node lost): that node's servers are set aside and replaced; a server that
            # comes back without a copy on its node waits for the next sync (engines/elastic.py bring_current).
            log.warning("weights v%d: node %s lost during the copy (%s); the sync goes on without it", version,
                        _node_label(server), type(e).__name__)  # fmt: skip
            self.writers.pop(server["node_id"], None)
            return None
        except ray.exceptions.RayError as e:
            raise RuntimeError(
                f"copying weights v{version} to node {_node_label(server)} failed: {type(e).__name__}: {e}"
            ) from e

    def close(self, remove: bool = True) -> None:
        if not remove:
            return
        if self.writers:
            if self.abandoned:  # a node that came back may still be writing: let it finish before its root goes
                import ray

                ray.wait(self.abandoned, num_returns=len(self.abandoned), timeout=ABANDONED_WAIT_S)
                self.abandoned = []
            remove_node_copies({self.node_root_name(n): h for n, h in self.writers.items()})
            self.writers = {}
        # The copies of nodes lost on this machine (their hosts could not remove them): the run is over, every root
        # with its tag here is its own.
        for root in node_roots_of_run(self.node_root_name("")):
            shutil.rmtree(root, ignore_errors=True)
        if self.root.name.startswith(ROOT_PREFIX):
            shutil.rmtree(self.root, ignore_errors=True)


def remove_node_copies(writers: dict[str, Any], timeout_s: float = 60.0) -> None:
    """Ask each engine host in `writers` ({node-local root name: host}) to delete its node's root, all at once. A
    host already gone (its node lost) is one line, without Ray's traceback: on a real cluster its copy stays on that
    machine (its /dev/shm is cleared with it); on this machine `close` deletes it."""
    import ray

    refs = {host.remove_weights.remote(name): name for name, host in writers.items()}
    ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref, name in refs.items():
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as e:
            log.warning("weights: %s not removed by its engine host: gone already (%s)", name, type(e).__name__)
        except Exception as e:  # the other nodes' copies are removed all the same; this one is reported
            log.warning("weights: %s not removed: %s", name, one_line(e))


def files_digest(directory: Path) -> str:
    """fa_digest's checksum of the safetensors in `directory`: the one its writer recorded in the index's metadata
    (training/hf_files.write_safetensors, the verl backend's export: taken from the tensors as written, nothing is
    read back), else computed from the files (a memory-mapped, sampled read: ~0.1-0.2 s at 101 M parameters here,
    docs/weight-transports.md; torch is imported only when there are tensors)."""
    from fully_async.vllm_ext.fa_digest import directory_digest, recorded_digest

    return recorded_digest(str(directory)) or directory_digest(str(directory))[0]


def _this_node() -> str | None:
    """This process's Ray node id; None outside Ray (then every server is a local child process). Ray is not
    imported for the question: a process that never imported it is not in a cluster, and the import costs seconds."""
    ray = sys.modules.get("ray")
    return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None


def _node_label(server: dict[str, Any]) -> str:
    return f"{server.get('node_ip', '?')} ({server['node_id']})"
