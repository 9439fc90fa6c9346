"""scripts/bench/env_failure_sweep.py's reading of a cell's reward curve (the issue-40 sweep table), on
trajectories built here: the mean per window, the first step whose trailing window reaches the threshold, the last
window's reward and tool-call rate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench" / "env_failure_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("env_failure_sweep", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_curve_of_a_cell(sweep):
    # 6 steps of 2 samples: step k's samples score k/10 and 0 (mean k/20); from step 4 on both called the tool.
    trajs = [
        {"step": k, "reward": r, "turns": 2 if k >= 4 else 1 + i}
        for k in range(1, 7)
        for i, r in enumerate([k / 10, 0.0])
    ]
    c = sweep.curve(trajs, steps=6, window=2, threshold=0.2)
    assert c["windows"] == [0.075, 0.175, 0.275]  # steps 1-2, 3-4, 5-6
    assert c["crossed"] == 5  # the trailing mean of steps 4-5 is 0.225; of 3-4, 0.175
    assert c["last_window"] == pytest.approx(0.275)
    assert c["tool_rate_last"] == 1.0
    early = sweep.curve(trajs, steps=6, window=3, threshold=0.9)
    assert early["crossed"] is None
    assert early["tool_rate_last"] == 1.0 and sweep.curve(trajs[:6], 3, 3, 0.0)["tool_rate_last"] == 0.5


def test_the_last_windows_reward_without_the_fake_zeros(sweep):
    # The last window (steps 3-4) holds a real 0.8, a real 0.0 and two samples zeroed by an infrastructure failure.
    trajs = [{"step": 3, "reward": 0.8}, {"step": 3, "reward": 0.0, "env_zeroed": True},
             {"step": 4, "reward": 0.0}, {"step": 4, "reward": 0.0, "env_zeroed": True}]  # fmt: skip
    c = sweep.curve(trajs, steps=4, window=2, threshold=1.0)
    assert c["last_window"] == pytest.approx(0.2)  # the logged mean counts the fake zeros
    assert c["last_window_real"] == pytest.approx(0.4)  # the policy's real reward does not
    assert c["windows_real"] == [0.0, 0.4] and c["windows"] == [0.0, 0.2]  # steps 1-2 hold nothing
    assert sweep.curve(trajs, steps=4, window=1, threshold=0.8)["crossed_real"] == 3  # step 3's real mean is 0.8
    assert sweep.curve(trajs, steps=4, window=1, threshold=0.8)["crossed"] is None  # its logged mean 0.4
    assert sweep.curve([], steps=2, window=2, threshold=1.0)["last_window_real"] == 0.0  # nothing: no division by 0
