"""The decoupled-PPO loss as the backend configures it (verl's vanilla policy loss), against hand computations."""

from __future__ import annotations

import pytest
import torch

from fully_async.config import RolloutCorrectionConfig
from fully_async.training.correction import correct


@pytest.fixture(scope="module")
def actor_config():
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, use_dynamic_bsz=True, clip_ratio_low=0.2, clip_ratio_high=0.28
    )


def _loss(config, log_prob, prox, adv, mask, weights=None):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    config.global_batch_info.clear()
    fn = get_policy_loss_fn("vanilla")
    loss, _ = fn(old_log_prob=prox, log_prob=log_prob, advantages=adv, response_mask=mask,
                 loss_agg_mode="token-mean", config=config, rollout_is_weights=weights)  # fmt: skip
    return loss


def _tis(prox, behave, mask, level="token", threshold=2.0):
    w, _ = correct(prox, behave, mask, RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=threshold))
    return w


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(3, 4, generator=g) * 3
    prox = log_prob + 0.4 * torch.randn(3, 4, generator=g)
    behave = prox + 0.6 * torch.randn(3, 4, generator=g)
    adv = torch.randn(3, 1, generator=g).expand(3, 4).contiguous()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]).bool()
    return log_prob, prox, behave, adv, mask


def test_decoupled_loss_matches_hand_computation(actor_config):
    log_prob, prox, behave, adv, mask = _inputs()
    w = _tis(prox, behave, mask)
    got = _loss(actor_config, log_prob, prox, adv, mask, w)
    ratio = torch.exp(log_prob - prox)
    clipped = torch.clamp(ratio, 1 - 0.2, 1 + 0.28)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)  # verl's dual clip, c = 3
    want = (per_token * torch.clamp(torch.exp(prox - behave), max=2.0) * mask).sum() / mask.sum()
    torch.testing.assert_close(got, want)


def test_decoupled_equals_plain_ppo_when_behaviour_is_proximal(actor_config):
    log_prob, prox, _, adv, mask = _inputs(1)
    w = _tis(prox, prox.clone(), mask)
    assert torch.allclose(w[mask], torch.ones(int(mask.sum())))
    torch.testing.assert_close(
        _loss(actor_config, log_prob, prox, adv, mask, w), _loss(actor_config, log_prob, prox, adv, mask)
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncation_caps_the_weights(level):
    _, prox, behave, _, mask = _inputs(2)
    behave = prox - 5.0  # pi_prox / pi_behave = e^5 per token, far above the cap
    w = _tis(prox, behave, mask, level, 1.5)
    assert torch.all(w[mask] == 1.5)
