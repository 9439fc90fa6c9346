"""The simulation's delayed reward: the same score, after a uniform delay scaled by the simulation's time scale."""

from __future__ import annotations

import time

from fully_async.reward import sim


async def test_delayed_score_waits_the_scaled_delay_and_scores_like_score(monkeypatch):
    monkeypatch.setenv(sim.DELAY_ENV, "1,2")
    monkeypatch.setenv(sim.SCALE_ENV, "10")
    for text in ("12", "7"):
        t = time.monotonic()
        got = await sim.delayed_score("sim", text, "")
        waited = time.monotonic() - t
        assert 0.1 <= waited < 0.4  # 1-2 simulated seconds at 10x
        assert got == await sim.score("sim", text, "")


async def test_no_delay_when_unset(monkeypatch):
    monkeypatch.delenv(sim.DELAY_ENV, raising=False)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr("asyncio.sleep", sleep)
    assert await sim.delayed_score("sim", "4", "") == 1.0
    assert slept == []  # not a short wait: none
