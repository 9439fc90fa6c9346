"""`python -m fully_async.ctl engines` (fully_async/ctl.py) asks the job's engine pool through the typed engine port
(weights/port.py): its list, add and remove reach the Rollouter's EngineService, here over the emulated engines of
engine=sim (which cannot start more servers: add is seen refused at the limit) with the job's actor run in this
process (LocalActor)."""

from __future__ import annotations

import pytest

from fully_async.config import EngineConfig
from fully_async.ctl import EnginePool
from fully_async.engines import EngineClient, build_engine
from fully_async.engines.service import EngineService
from fully_async.handles import LocalActor, resolve

pytestmark = pytest.mark.timeout(60)


class _Job:
    """The Rollouter's side of the port: `engine(call, *args)` answered by an EngineService over sim servers."""

    def __init__(self) -> None:
        servers = build_engine(
            EngineConfig(kind="sim", num_servers=2, min_servers=1, max_servers=2), "/nonexistent", "/tmp"
        )
        self.client = EngineClient(servers, auto_restart=False)
        self.service = EngineService(servers, self.client)

    async def engine(self, call: str, *args):
        return await self.service.call(call, *args)

    async def stop(self) -> None:
        await self.client.close()


def test_ctl_lists_adds_and_removes_engine_servers_through_the_port():
    handle = LocalActor(_Job())
    pool = EnginePool(handle, "/run")
    try:
        assert [(r["url"], r["state"]) for r in pool.list()] == [("sim://engine-0", "serving"),
                                                                  ("sim://engine-1", "serving")]  # fmt: skip
        with pytest.raises(ValueError, match="adding 1 passes engine.max_servers=2"):  # sim servers cannot join
            pool.add(1)
        assert pool.remove("sim://engine-0") == {"removed": "sim://engine-0", "moved": 0, "live": 1}
        assert [r["state"] for r in pool.list()] == ["removed", "serving"]
    finally:
        resolve(handle.stop.remote())
        handle.close()
