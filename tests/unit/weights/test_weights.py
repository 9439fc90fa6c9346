"""The weight-transport factory and the disk transport without Ray (stub rollouter at the edge, simulated backend):
its phases, which nodes get a copy, the node-local copy, and the engine pool's reload routed to each node's copy
(fake engines at the HTTP edge). The 2-node version runs in tests/integration/test_disk_transport_cluster.py."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from fully_async.config import AlgorithmConfig, ConfigError, EngineConfig, SimTrainerConfig, TrainerConfig
from fully_async.engines import build_engine
from fully_async.engines.elastic import bring_current
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync
from fully_async.training.sim_backend import SimBackend
from fully_async.weights import build_transport
from fully_async.weights.base import queued_export
from fully_async.weights.disk import (
    ROOT_PREFIX,
    DiskTransport,
    claim_weights_root,
    copy_plan,
    default_weights_root,
    file_chunks,
    node_root,
    remove_dead_node_roots,
    write_node_copy,
)
from tests.fakes import FakeEngine, StubRollouter


@pytest.fixture
def backend():
    return SimBackend(TrainerConfig(backend="sim", sim=SimTrainerConfig(time_scale=1e4)), AlgorithmConfig())


@pytest.mark.parametrize("kind", ["disk", "auto"])
def test_disk_and_auto_build_the_disk_transport(kind, backend, tmp_path):
    transport = build_transport(kind, None, backend, tmp_path / "w", "bfloat16")
    assert isinstance(transport, DiskTransport) and transport.dtype == "bfloat16"


def test_collective_needs_a_backend_that_can_send_and_unknown_kinds_are_refused(backend, tmp_path):
    with pytest.raises(ConfigError, match="SimBackend training backend cannot send weights collectively"):
        build_transport("collective", None, backend, tmp_path, "float32")
    with pytest.raises(ConfigError, match="one of \\['disk', 'collective', 'auto'\\], got 'nfs'"):
        build_transport("nfs", None, backend, tmp_path, "float32")


def test_disk_phases_export_then_reload_that_directory_as_the_version(backend, tmp_path):
    stub = StubRollouter()
    handle = LocalActor(stub)
    try:
        transport = DiskTransport(handle, backend, tmp_path / "w", "float32")
        names = []
        plan = transport.plan(4, background=False)
        for name, fn in plan.reads + plan.ahead + plan.engines:
            names.append(name)
            fn()
    finally:
        handle.close()
    assert names == ["export", "distribute", "reload"]
    assert (tmp_path / "w" / "v4" / "sim_weights.json").is_file()
    assert stub.calls == [("load_weights", str(tmp_path / "w" / "v4"), 4)] and stub.version == 4


class _QueuingBackend(SimBackend):
    """The sim backend handing the export phases of a backend whose copy is only queued (as the verl backend's):
    `stage_weights` (here the whole export) in `queue`, its finishing call in a `write` phase."""

    def sync_export(self, out_dir, dtype="float32"):
        return queued_export(self.stage_weights, out_dir, dtype)


class _ExportsOnly:
    """A stand-in backend with `export_weights` alone (as tests' state-dict backends)."""

    def __init__(self, backend) -> None:
        self.export_weights = backend.export_weights


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_the_disk_plan_opens_with_the_export_phases_the_backend_hands_it(backend, tmp_path, mode):
    stub = StubRollouter()
    handle = LocalActor(stub)
    queuing = _QueuingBackend(backend.cfg, AlgorithmConfig())
    try:
        plans = {
            kind: DiskTransport(handle, b, tmp_path / kind, "float32").plan(2, mode == "background")
            for kind, b in (("queued", queuing), ("whole", backend), ("stand-in", _ExportsOnly(backend)))
        }
        for fn in (f for _, f in plans["queued"].queue + plans["queued"].ahead):
            fn()
    finally:
        handle.close()
    assert [n for n, _ in plans["queued"].queue] == ["export"] and not plans["queued"].reads
    assert plans["queued"].names() == ["export", "write", "pause", "distribute", "reload", "resume"]
    assert (tmp_path / "queued" / "v2" / "sim_weights.json").is_file()
    for kind in ("whole", "stand-in"):
        assert [n for n, _ in plans[kind].reads] == ["export"] and not plans[kind].queue, kind
        assert plans[kind].names() == ["export", "pause", "distribute", "reload", "resume"], kind


def test_param_sync_takes_the_transport_by_name_or_instance_and_close_removes_only_its_own_root(backend, tmp_path):
    own = default_weights_root(tmp_path)
    sync = ParamSync(None, backend, own, "float32", 5.0, transport="auto")
    assert isinstance(sync.transport, DiskTransport) and sync.transport.root == own
    sync.close()
    assert not own.exists() or own == tmp_path / "weights"  # a /dev/shm root it created is removed

    given = tmp_path / "user-weights"
    transport = DiskTransport(None, backend, given, "float32")
    sync = ParamSync(None, backend, tmp_path / "unused", "float32", 5.0, transport=transport)
    assert sync.transport is transport and sync.export(3) == given / "v3"
    sync.close()
    assert (given / "v3").is_dir()  # a root the caller chose is never removed


# -- several nodes: which nodes get a copy, the node-local copy itself, and the reload routed to it ----------------
def test_copy_plan_picks_one_writer_per_node_other_than_the_trainers():
    a0, a1, b0 = object(), object(), object()
    servers = [
        {"node_id": "head", "node_ip": "10.0.0.1", "host": None},  # a child of the rollouter: reads the export
        {"node_id": "nodeA", "node_ip": "10.0.0.2", "host": a0},
        {"node_id": "nodeA", "node_ip": "10.0.0.2", "host": a1},  # same node: no second copy
        {"node_id": None, "node_ip": None, "host": None},  # outside Ray: local
        {"node_id": "nodeB", "node_ip": "10.0.0.3", "host": b0},
    ]
    plan = copy_plan(servers, here="head")
    assert list(plan) == ["nodeA", "nodeB"]
    assert plan["nodeA"]["host"] is a0 and plan["nodeB"]["host"] is b0
    assert copy_plan(servers[:1] + servers[3:4], here="head") == {}  # one node: nothing to copy


def test_copy_plan_refuses_a_server_elsewhere_that_has_no_host_naming_it():
    with pytest.raises(ValueError, match=r"engine server 1 runs on node 10.0.0.9 \(far\), not the trainer's"):
        copy_plan([{"node_id": "head"}, {"node_id": "far", "node_ip": "10.0.0.9", "host": None}], here="head")


@pytest.fixture
def node_name():
    name = f"{ROOT_PREFIX}unit-{uuid.uuid4().hex[:8]}"
    yield name
    shutil.rmtree(node_root(name), ignore_errors=True)


def test_node_copy_round_trips_the_files_in_chunks_keeps_the_previous_version_and_prunes_older(tmp_path, node_name):
    src = tmp_path / "v1"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 3)
    (src / "sub" / "tokenizer.json").write_text('{"a": 1}')
    (src / "empty").write_bytes(b"")
    puts = []
    files = file_chunks(src, lambda arr: puts.append(arr) or arr, chunk_bytes=100)
    assert [name for name, _ in files] == ["empty", "model.safetensors", "sub/tokenizer.json"]
    assert [len(chunks) for _, chunks in files] == [0, 8, 1] and max(len(p) for p in puts) == 100
    for version in (1, 2, 3):
        out = write_node_copy(node_name, version, files, lambda chunk: chunk)
        assert out == node_root(node_name) / f"v{version}"
    for name in ("model.safetensors", "sub/tokenizer.json", "empty"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert sorted(p.name for p in node_root(node_name).iterdir()) == ["v2", "v3"]  # no temp dirs left either


def test_a_node_copy_that_fails_midway_leaves_no_version_directory(node_name):
    def broken(chunk):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_node_copy(node_name, 5, [("a", [b"x"])], broken)
    assert list(node_root(node_name).iterdir()) == []
    with pytest.raises(ValueError, match="outside the version's directory"):
        write_node_copy(node_name, 5, [("../escape", [b"x"])], lambda c: c)


def test_a_new_writer_removes_this_runs_copies_of_lost_nodes_on_its_machine_and_nothing_else():
    tag = f"{ROOT_PREFIX}unit-{uuid.uuid4().hex[:8]}"
    other_run = f"{ROOT_PREFIX}unit-{uuid.uuid4().hex[:8]}-node-cccccccccccc"
    mine, alive, lost = (f"{tag}-node-{n * 12}" for n in "abd")
    try:
        for name in (mine, alive, lost, other_run):
            write_node_copy(name, 1, [("w", [b"x"])], lambda c: c)
        # node ids are 56 hex digits; a root names the first 12 of its node's
        removed = remove_dead_node_roots(mine, {"a" * 56, "b" * 56})
        assert removed == [node_root(lost)]
        assert [node_root(n).exists() for n in (mine, alive, lost, other_run)] == [True, True, False, True]
    finally:
        for name in (mine, alive, lost, other_run):
            shutil.rmtree(node_root(name), ignore_errors=True)


async def test_the_reload_goes_to_each_nodes_copy_and_a_restarted_server_reloads_its_nodes_copy(tmp_path):
    fakes = [await FakeEngine().start() for _ in range(3)]
    servers = build_engine(
        EngineConfig(control_timeout_s=5.0), "/nonexistent", tmp_path, addresses=[f.url for f in fakes]
    )
    # Which node each server is on comes from its engine host (Ray) in a run; here servers 0 and 1 share nodeB.
    nodes = ["nodeB", "nodeB", None]
    servers.node_of = lambda i: {"node_id": nodes[i], "node_ip": None, "host": None}
    src, copy_b = tmp_path / "src" / "v1", tmp_path / "nodeB" / "v1"
    src.mkdir(parents=True)
    copy_b.mkdir(parents=True)
    try:
        await servers.load_weights(src, 1, {"nodeB": str(copy_b)})
        assert [f.reloads for f in fakes] == [[str(copy_b)], [str(copy_b)], [str(src)]]
        assert [f.version for f in fakes] == ["1"] * 3
        await bring_current(servers, [1])  # what restart() runs once the server is healthy again
        assert fakes[1].reloads == [str(copy_b)] * 2
        await servers.load_weights(src, 2)  # back on one node: everything from the source
        assert [f.reloads[-1] for f in fakes] == [str(src.resolve())] * 3 and servers.weights.node_dirs == {}
    finally:
        for f in fakes:
            await f.stop()


def test_a_run_directory_claims_its_root_and_removes_only_a_root_its_previous_run_left_in_dev_shm(tmp_path):
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    run_dir = tmp_path / "run"
    killed = default_weights_root(run_dir)  # the root of a run that was killed before it could remove it
    (killed / "v3").mkdir()
    assert claim_weights_root(run_dir, killed) is None  # nothing recorded before: nothing removed
    resumed = default_weights_root(run_dir)
    try:
        assert claim_weights_root(run_dir, resumed) == killed
        assert not killed.exists() and resumed.is_dir()
        assert (run_dir / ".weights_root").read_text().strip() == str(resumed)
        # a recorded path that is not a root under /dev/shm (an edited or foreign record) is never removed
        elsewhere = tmp_path / "fully_async-weights-elsewhere"
        elsewhere.mkdir()
        (run_dir / ".weights_root").write_text(str(elsewhere))
        assert claim_weights_root(run_dir, resumed) is None and elsewhere.is_dir()
    finally:
        shutil.rmtree(resumed, ignore_errors=True)
