"""Validation: the held-out accuracy of the weights the engines serve, measured beside training.

Contract (one instance per Rollouter, all on its event loop):
- `rows` are the held-out rows (data.val_files or the synthetic task's val split; empty = never validate), `bind`
  gives the validation agent loop, the engine client and the RewardAgent once the engines serve, and validates the
  weights training starts from under trainer.val_before_train.
- One pass at a time, each under one weights version: `start(version)`, `after_sync(version)` at
  every version trainer.val_every divides (skipped while a pass still runs: an adapter sync does not wait for it),
  and `final(version)`, the weights a run ends with (a pass at that version unless one ran or runs at it).
- `settle()` waits for the running pass (a sync's pause does, so a pass never spans two versions); `pop()` hands
  each result once: {"version", "val/reward_mean", "val/n", "timing_s/validation"}.
- A pass that fails is logged and training goes on; a RewardFatal (reward.on_failure=raise) goes to `on_fatal`,
  which stops the run as a training failure would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fully_async.agents import Sample
from fully_async.config import FullyAsyncConfig
from fully_async.data import PromptRow
from fully_async.envs.failures import InfraExhausted
from fully_async.production import sample_id
from fully_async.protocol import PromptRef
from fully_async.reward import RewardDrop, RewardFatal
from fully_async.trace import Tracer

log = logging.getLogger(__name__)


class Validation:
    def __init__(self, cfg: FullyAsyncConfig, tracer: Tracer, on_fatal: Callable[[str], None]) -> None:
        self.cfg, self.tracer, self.on_fatal = cfg, tracer, on_fatal
        self.rows: list[PromptRow] = []
        self.agent: Any = None
        self.client: Any = None
        self.reward: Any = None
        self._task: asyncio.Task | None = None
        self._results: deque[dict[str, Any]] = deque()
        self._started: int | None = None
        """The version of the last pass started."""

    def bind(self, agent: Any, client: Any, reward: Any, version: int) -> None:
        self.agent, self.client, self.reward = agent, client, reward
        if self.cfg.trainer.val_before_train:  # the weights training starts from
            self.start(version)

    def start(self, version: int) -> None:
        if self.rows:
            self._task = asyncio.get_running_loop().create_task(self._run(version))

    def after_sync(self, version: int) -> None:
        if self._task is not None and not self._task.done():
            return
        val_every = self.cfg.trainer.val_every
        if val_every and version % val_every == 0:
            self.start(version)

    async def settle(self) -> None:
        if self._task is not None:
            await self._task
            self._task = None

    async def final(self, version: int) -> list[dict[str, Any]]:
        """The pass at `version` (run now unless one ran or runs at it), with every result not yet popped."""
        if self._started != version:
            await self.settle()
            self.start(version)
        await self.settle()
        return self.pop()

    def pop(self) -> list[dict[str, Any]]:
        out = list(self._results)
        self._results.clear()
        return out

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self, version: int) -> None:
        wall_start = time.time()
        self._started = version
        ro = self.cfg.rollout
        try:
            self._results.append(await validate(self.agent, self.client, self.reward, self.rows, version,
                                                ro.val_max_concurrent, ro.val.n))  # fmt: skip
            self.tracer.record("rollouter", "validation", wall_start, time.time(), version=version)
        except RewardFatal as e:  # on_failure=raise holds for validation too
            self.on_fatal(str(e))
        except Exception as e:  # validation must not stop training; its failure is logged
            log.warning("validation at version %d failed: %s", version, e)


async def validate(
    agent: Any, client: Any, reward: Any, rows: list[PromptRow], version: int, max_concurrent: int, n: int = 1
) -> dict[str, Any]:
    """`n` samples per held-out row under weights `version`, scored: {"version", "val/reward_mean", "val/n",
    "timing_s/validation"}. A sample a reward source drops or whose environment failed past its retries (training
    would re-issue both) is left out of the mean; RewardFatal (on_failure=raise) propagates."""
    limit = asyncio.Semaphore(max_concurrent)
    start = time.monotonic()

    async def one(i: int, row: PromptRow, k: int) -> float | None:
        sample_id.set(f"val:{version}:{i}" + (f":{k}" if k else ""))
        async with limit:
            try:
                out = await agent.run(client, Sample(PromptRef(-1, i), k, row))
                last = out[-1] if isinstance(out, list) else out
                return (await reward.score(agent.reward_text(last), agent.reward_meta(last, row))).score
            except (RewardDrop, InfraExhausted):
                return None

    samples = (one(i, r, k) for i, r in enumerate(rows) for k in range(n))
    scores = [s for s in await asyncio.gather(*samples) if s is not None]
    return {"version": version, "val/reward_mean": sum(scores) / len(scores) if scores else float("nan"),
            "val/n": len(scores), "timing_s/validation": time.monotonic() - start}  # fmt: skip
