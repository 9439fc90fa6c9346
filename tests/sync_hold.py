"""A transport for tests that must act at an exact point of a sync: the disk transport whose sync of one version,
once the engines are paused, creates a marker file and holds still (a phase of its own, `test_hold`, under the sync
timeout) until the marker is removed, so that a test can kill the run exactly between pause and reload
(tests/integration/test_background_sync.py). Chosen with
`async_training.weight_transport=tests.sync_hold:HoldingDiskTransport` and HOLD_ENV="VERSION:PATH" in the job's
environment: a transport written outside fully_async, as a user's would be."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from fully_async.weights.base import SyncPlan
from fully_async.weights.disk import DiskTransport

HOLD_ENV = "FULLY_ASYNC_TEST_HOLD_SYNC"
TRANSPORT = "tests.sync_hold:HoldingDiskTransport"


class HoldingDiskTransport(DiskTransport):
    name = "disk+hold"

    def plan(self, version: int, background: bool) -> SyncPlan:
        plan = super().plan(version, background)
        held, _, path = os.environ.get(HOLD_ENV, "").partition(":")
        if not held or int(held) != version:
            return plan
        marker = Path(path)

        def hold() -> None:
            marker.touch()
            while marker.exists():
                time.sleep(0.05)

        return dataclasses.replace(plan, engines=(("test_hold", hold), *plan.engines))
