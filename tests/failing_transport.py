"""A transport for tests whose every sync fails inside a Ray task with an IndexError, as issue 48's export did in a
trainer rank: the run must end with one console line and its whole traceback, the task's remote frames included, in
RUN_DIR/logs/error.log (tests/integration/test_failure_log.py). Chosen with
`async_training.weight_transport=tests.failing_transport:FailingTransport`: a transport written outside fully_async."""

from __future__ import annotations

import ray

from fully_async.weights.base import SyncPlan
from fully_async.weights.disk import DiskTransport

TRANSPORT = "tests.failing_transport:FailingTransport"


@ray.remote(num_cpus=0)
def write_the_weights(version: int) -> None:
    raise IndexError(f"index {version} is out of bounds for dimension 0 with size {version}")


class FailingTransport(DiskTransport):
    name = "disk+fail"

    def plan(self, version: int, background: bool) -> SyncPlan:
        return SyncPlan(reads=(("export", lambda: ray.get(write_the_weights.remote(version))),))
