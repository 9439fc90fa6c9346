"""The session's 2-node loopback cluster (tests/local_cluster.py starts it with scripts/cluster/).

`two_node_cluster` is the session fixture (registered for every test by tests/conftest.py): a head with no GPUs and
one worker declaring 4, started once per session and stopped at its end, failing the session's last user if stop.sh
leaves a process behind.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.local_cluster import LocalCluster, start_cluster


@pytest.fixture(scope="session")
def two_node_cluster() -> Iterator[LocalCluster]:
    """A head (no GPUs) and a worker declaring 4 GPUs on loopback, for the whole session; stopped with stop.sh at
    the end, which must leave no process the scripts started."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        result, left = cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    assert result.returncode == 0, result.stdout
    assert not left, f"stop.sh left processes running: {left}\n{result.stdout}"
