"""PPO with a critic on verl's engine (real Ray ranks on CPU, the tiny model): values on each batch, GAE, the critic's
update (world size 2 equals world size 1, as for the policy), value metrics, and the critic in checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from fully_async.config import AlgorithmConfig, TinyModelConfig, TrainerConfig
from fully_async.protocol import flatten
from tests.training_data import make_groups

pytestmark = pytest.mark.timeout(900)

GAE = dict(adv_estimator="gae")  # gamma = lam = 1: every return is the outcome reward


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fully_async.models.tiny import build_tiny_model

    return build_tiny_model(
        TinyModelConfig(hidden_size=64, intermediate_size=128), cache_dir=tmp_path_factory.mktemp("m")
    )


def _backend(model, world_size, tmp):
    from fully_async.training import build_backend

    trainer = TrainerConfig(n_gpus_per_node=world_size, max_token_len_per_gpu=512, total_steps=20, critic_lr=1e-3)
    be = build_backend(trainer, AlgorithmConfig(**GAE), model, temperature=0.9, device="cpu")
    be.save_checkpoint(tmp / "init", 0)
    be.fa_init = tmp / "init"
    return be


@pytest.fixture(scope="module")
def critic1(ray_local, tiny_model, tmp_path_factory):
    be = _backend(tiny_model, 1, tmp_path_factory.mktemp("c1"))
    yield be
    be.shutdown()


def _values(be, groups):
    return np.concatenate(be.compute_values(groups))


def test_gae_step_trains_the_critic_towards_the_returns(critic1):
    critic1.load_checkpoint(critic1.fa_init)
    groups = make_groups(3, 2, seed=5)
    before = _values(critic1, groups)
    m = critic1.update(groups)
    for key in ("critic/vf_loss", "critic/vf_explained_var", "critic/value_mse", "critic/grad_norm", "actor/pg_loss"):
        assert np.isfinite(m[key]), (key, m)
    # The values reported for this step are the critic's before its update, on exactly this batch.
    rewards = np.concatenate([np.full(len(t.response_ids), t.reward) for t in flatten(groups)])
    assert m["critic/value_mse"] == pytest.approx(float(np.mean((before - rewards) ** 2)), rel=1e-3)
    errors = [m["critic/value_mse"]]
    for _ in range(6):
        errors.append(critic1.update(groups)["critic/value_mse"])
    assert errors[-1] < 0.5 * errors[0], errors  # gamma = 1, so every token's return is the outcome reward
    assert not np.allclose(_values(critic1, groups), before)


def test_resume_restores_the_critic(critic1, tmp_path):
    critic1.load_checkpoint(critic1.fa_init)
    g1, g2 = make_groups(2, 2, seed=21), make_groups(2, 2, seed=22)
    critic1.update(g1)
    critic1.save_checkpoint(tmp_path / "ck", 1)
    ma = critic1.update(g2)
    va = _values(critic1, g2)
    assert critic1.load_checkpoint(tmp_path / "ck") == 1
    mb = critic1.update(g2)
    vb = _values(critic1, g2)
    assert ma["critic/vf_loss"] == mb["critic/vf_loss"] and ma["critic/grad_norm"] == mb["critic/grad_norm"]
    np.testing.assert_array_equal(va, vb)
    critic1.load_checkpoint(critic1.fa_init)  # and the initial critic is a different one
    assert not np.array_equal(_values(critic1, g2), vb)


def test_critic_update_world_size_2_matches_world_size_1(critic1, tiny_model, tmp_path):
    be2 = _backend(tiny_model, 2, tmp_path / "c2")
    try:
        critic1.load_checkpoint(critic1.fa_init)
        groups = make_groups(3, 3, seed=11)  # 9 trajectories: not divisible by 2 ranks
        v1, v2 = _values(critic1, groups), _values(be2, groups)
        m1, m2 = critic1.update(groups), be2.update(groups)
        np.testing.assert_allclose(v1, v2, atol=1e-5)  # the same score head, whatever the sharding
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_explained_var", "actor/loss", "actor/grad_norm"):
            assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
        np.testing.assert_allclose(_values(critic1, groups), _values(be2, groups), atol=2e-5)
    finally:
        be2.shutdown()
