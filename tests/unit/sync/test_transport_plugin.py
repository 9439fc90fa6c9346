"""A transport written outside fully_async (`async_training.weight_transport=pkg.module:Class`) is built by the one
factory and run by ParamSync from its plan alone: the test transport here touches no file of the package."""

from __future__ import annotations

from pathlib import Path

import pytest

from fully_async.config import ConfigError, FullyAsyncConfig
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync
from fully_async.weights.base import SyncPlan, WeightTransport
from fully_async.weights.factory import build_transport
from tests.fakes import StubRollouter

ME = "tests.unit.sync.test_transport_plugin"


class RecordingTransport(WeightTransport):
    """Records its phases; reads, ahead and engines as a real transport splits them."""

    name = "recording"

    def __init__(self, rollouter, backend, root, dtype, verify=True) -> None:
        self.root, self.ran = Path(root), []
        self.seen = rollouter  # the stub's calls: what had run on the engines when each phase ran

    def plan(self, version: int, background: bool) -> SyncPlan:
        def note(name: str):
            return name, lambda: self.ran.append(f"{name} v{version} after {[c[0] for c in self.seen.calls]}")

        return SyncPlan(reads=(note("read"),), ahead=(note("write"),), engines=(note("load"),))

    def export(self, version: int) -> Path:
        return self.root

    def close(self, remove: bool = True) -> None:
        self.ran.append("closed")


class NotATransport:
    pass


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_a_transport_named_by_its_dotted_path_runs_its_plan_in_order_around_the_pause(tmp_path, mode):
    stub = StubRollouter()
    handle = LocalActor(stub)
    sync = ParamSync(stub, None, tmp_path, "float32", 10.0, transport=f"{ME}:RecordingTransport", mode=mode)
    sync.rollouter = handle  # the transport reads the stub's calls directly; ParamSync calls it through the handle
    try:
        assert isinstance(sync.transport, RecordingTransport)
        timings = {**sync.sync(3), **sync.wait()}
    finally:
        sync.close()
        handle.close()
    assert sync.transport.ran == ["read v3 after []", "write v3 after []", "load v3 after ['pause']", "closed"]
    assert [c[0] for c in stub.calls] == ["pause", "resume"]
    assert sync.transport.plan(3, mode == "background").names() == ["read", "write", "pause", "load", "resume"]
    assert {"timing_s/param_sync/read", "timing_s/param_sync/load", "timing_s/param_sync/pause"} <= set(timings)


def test_a_dotted_path_that_is_not_a_transport_or_not_a_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="must name a WeightTransport subclass"):
        build_transport(f"{ME}:NotATransport", None, None, tmp_path, "float32")
    with pytest.raises(ConfigError, match="cannot import module"):
        build_transport("tests.no_such_module:X", None, None, tmp_path, "float32")
    cfg = FullyAsyncConfig()
    cfg.async_training.weight_transport = "nfs"
    with pytest.raises(ConfigError, match="weight_transport.*dotted path"):
        cfg.validate()
