"""What a server that joins or comes back must load before it serves (fully_async/engines/served.py): the pool's
`weights`, written by its syncs (control.py) and read against the version the pool shares with its clients."""

from __future__ import annotations

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import build_engine
from fully_async.engines.served import ServedWeights
from fully_async.engines.types import EngineState
from tests.fakes import FakeProcessServers

pytestmark = pytest.mark.timeout(60)


def test_a_server_comes_back_stale_only_when_the_latest_weights_are_in_no_directory_and_no_adapter(tmp_path):
    state = EngineState()
    weights = ServedWeights(state)
    assert not weights.stale_on_return  # version 0: the start-up weights are the current ones
    state.version = 2
    assert weights.stale_on_return  # version 2 came by collective: in no directory
    weights.directory = tmp_path
    assert not weights.stale_on_return  # a comeback reloads it
    weights.directory = None
    assert not ServedWeights(state, adapters=object()).stale_on_return  # the base model plus the current adapter


async def test_the_pools_syncs_write_its_weights_and_its_version_is_the_one_they_read():
    pool = build_engine(EngineConfig(kind="sim", num_servers=2), "/nonexistent", "/tmp")
    assert pool.weights.directory is None and pool.weights.node_dirs == {} and pool.weights.adapters is None
    await pool.load_weights("/tmp", 1)  # a disk sync: a comeback reloads its directory
    assert pool.weights.directory is not None and pool.state.version == 1 and not pool.weights.stale_on_return
    await pool.weights_received(2, pool.weights.epoch)  # a collective sync: version 2 is in no directory
    assert pool.weights.directory is None and pool.state.version == 2 and pool.weights.stale_on_return


def test_the_pool_keeps_its_weights_in_one_place(tmp_path):
    pool = FakeProcessServers(EngineConfig(), tmp_path, tmp_path)
    assert pool.weights.epoch == 0
    for moved in ("weights_dir", "node_dirs", "adapters", "epoch", "weight_receiver", "stale_on_return"):
        assert not hasattr(pool, moved), f"the pool holds `{moved}` again: it is `pool.weights`'s (served.py)"
