"""The simulated training backend's cost model and contract (trainer=sim)."""

from __future__ import annotations

import json
import time

import pytest

from fully_async.config import AlgorithmConfig, SimTrainerConfig, TrainerConfig
from fully_async.training import build_backend
from tests.helpers import make_group


def backend(recompute_prox: bool, time_scale: float = 1e6, **sim):
    cfg = TrainerConfig(
        backend="sim", num_mini_batches=3, ppo_epochs=2, sim=SimTrainerConfig(time_scale=time_scale, **sim)
    )
    return build_backend(cfg, AlgorithmConfig(recompute_prox=recompute_prox), "/nonexistent")


SIM = dict(gpus=4, train_tokens_per_s_per_gpu=100.0, logprob_tokens_per_s_per_gpu=400.0, optimizer_step_s=0.5)


@pytest.mark.parametrize("recompute_prox", [False, True])
def test_update_time_is_fixed_cost_plus_tokens(recompute_prox):
    groups = [make_group(i, n=2, response_len=8, prompt_len=4) for i in range(5)]  # 5 x 2 x 12 = 120 tokens
    out = backend(recompute_prox, **SIM).update(groups, version=0)
    assert out["sim/tokens"] == 120
    assert out["sim/train_s"] == pytest.approx(2 * (0.5 * 3 + 120 / (100 * 4)))
    assert out["sim/logprob_s"] == pytest.approx(120 / (400 * 4) if recompute_prox else 0.0)


def test_update_sleeps_the_scaled_time_and_exports_take_model_size_over_bandwidth(tmp_path):
    b = backend(False, time_scale=100.0, **SIM)  # 2 x (1.5 + 48 / 400) = 3.24 simulated s -> 32 ms
    start = time.monotonic()
    b.update([make_group(0, n=2, response_len=20, prompt_len=4)])
    assert time.monotonic() - start >= 0.03
    b = backend(False, model_gb=2.0, export_gb_per_s=4.0)
    files = b.export_weights(tmp_path / "v1")
    assert b.busy_s == pytest.approx(0.5) and files[0].is_file()


def test_checkpoint_round_trip_and_log_probs_are_the_behaviour_ones(tmp_path):
    b = backend(False)
    b.save_checkpoint(tmp_path / "ck", step=7)
    assert json.loads((tmp_path / "ck" / "sim_backend.json").read_text())["step"] == 7
    assert backend(False).load_checkpoint(tmp_path / "ck") == 7
    group = make_group(0, n=2, response_len=5)
    (lp, _) = b.compute_log_probs([group])
    assert list(lp) == list(group.trajectories[0].behaviour_logprobs) and b.world_size == 1
