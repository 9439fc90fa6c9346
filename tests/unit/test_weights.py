"""The weight-transport factory and the disk transport without Ray (stub rollouter at the edge, simulated backend)."""

from __future__ import annotations

import pytest

from fully_async.config import AlgorithmConfig, ConfigError, SimTrainerConfig, TrainerConfig
from fully_async.handles import LocalActor
from fully_async.param_sync import ParamSync
from fully_async.training.sim_backend import SimBackend
from fully_async.weights import build_transport
from fully_async.weights.disk import DiskTransport, default_weights_root
from tests.fakes import StubRollouter


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
        for name, fn in transport.phases(4):
            names.append(name)
            fn()
    finally:
        handle.close()
    assert names == ["export", "reload"]
    assert (tmp_path / "w" / "v4" / "sim_weights.json").is_file()
    assert stub.calls == [("load_weights", str(tmp_path / "w" / "v4"), 4)] and stub.version == 4


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
