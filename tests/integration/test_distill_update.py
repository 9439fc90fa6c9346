"""Pure distillation through the verl backend (real Ray ranks on CPU), full fine-tuning and LoRA, under the default
rollout correction (decoupled, token IS): samples whose teacher puts more mass on a token than the student did get
it raised, tokens the teacher disfavours get lowered, and the step reports the reverse KL to the teacher."""

from __future__ import annotations

import numpy as np
import pytest

from fully_async.config import AlgorithmConfig, DistillConfig, LoraConfig, TinyModelConfig, TrainerConfig
from fully_async.protocol import flatten
from tests.training_data import make_groups

pytestmark = pytest.mark.timeout(600)

SHIFT = 1.0
"""The teacher's log-prob is the student's + SHIFT on the favoured sample of a group, - SHIFT on the other."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fully_async.models.tiny import build_tiny_model

    return build_tiny_model(
        TinyModelConfig(hidden_size=64, intermediate_size=128), cache_dir=tmp_path_factory.mktemp("m")
    )


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_pure_distillation_moves_the_student_toward_the_teacher(ray_local, tiny_model, lora):
    from fully_async.training import build_backend

    trainer = TrainerConfig(n_gpus_per_node=1, max_token_len_per_gpu=512, total_steps=20, lr=1e-2)
    be = build_backend(trainer, AlgorithmConfig(), tiny_model, device="cpu",
                       lora=LoraConfig(rank=8, alpha=16, lr=3e-2) if lora else None,
                       distill=DistillConfig(enable=True, coef=1.0))  # fmt: skip
    try:
        groups = make_groups(4, 2, seed=3, response_len=(3, 6))
        trajs = flatten(groups)
        before = be.compute_log_probs(groups)
        for t, lp in zip(trajs, before):
            t.behaviour_logprobs = lp.astype(np.float32)  # on-policy: sampled by the student as it is
            sign = 1.0 if t.sample_index == 0 else -1.0
            t.teacher_logprobs = (lp + sign * SHIFT).astype(np.float32)
        metrics = {}
        for _ in range(3):
            metrics = be.update(groups, version=0)
        after = be.compute_log_probs(groups)
    finally:
        be.shutdown()
    assert metrics["distill/tokens"] == sum(t.response_length for t in trajs)
    moved = [float(np.mean(a - b)) for a, b in zip(after, before)]
    favoured = [m for t, m in zip(trajs, moved) if t.sample_index == 0]
    disfavoured = [m for t, m in zip(trajs, moved) if t.sample_index == 1]
    assert min(favoured) > 0 and max(disfavoured) < 0, (favoured, disfavoured)
    # The step's reverse-KL estimate: mean(behave - teacher) = -SHIFT x (favoured - disfavoured tokens) / tokens,
    # measured on the third step's batch (the same samples, behaviour log-probs as given).
    fav = sum(t.response_length for t in trajs if t.sample_index == 0)
    expect = SHIFT * (sum(t.response_length for t in trajs) - 2 * fav) / sum(t.response_length for t in trajs)
    assert metrics["distill/teacher_kl"] == pytest.approx(expect, abs=1e-5)
    assert "offpolicy/k3" in metrics  # the decoupled correction ran on the same batch


def test_a_student_that_equals_the_teacher_is_not_moved_by_stale_samples(ray_local, tiny_model):
    """The signal is taken against the trainer's current log-probs (pi_prox), not the ones the samples were drawn
    with: a teacher that says exactly what the student now says gives no signal, however far the behaviour policy
    was from both (here every token's behaviour log-prob is 1.0 below the student's, as for a sample from a policy
    that has since moved toward the teacher). Against pi_behave every token would get +1.0 and rise."""
    from fully_async.training import build_backend

    trainer = TrainerConfig(n_gpus_per_node=1, max_token_len_per_gpu=512, total_steps=20, lr=1e-2)
    be = build_backend(trainer, AlgorithmConfig(), tiny_model, device="cpu",
                       distill=DistillConfig(enable=True, coef=1.0))  # fmt: skip
    try:
        groups = make_groups(4, 2, seed=5, response_len=(3, 6))
        trajs = flatten(groups)
        before = be.compute_log_probs(groups)
        for t, lp in zip(trajs, before):
            t.behaviour_logprobs = (lp - SHIFT).astype(np.float32)
            t.teacher_logprobs = lp.astype(np.float32)
        metrics = be.update(groups, version=2)
        after = be.compute_log_probs(groups)
    finally:
        be.shutdown()
    assert abs(metrics["distill/advantage_mean"]) < 1e-4, metrics["distill/advantage_mean"]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(after, before))
    assert moved < 1e-3, moved
    # The KL metric describes the sampled policy: mean(behave - teacher) = -SHIFT.
    assert metrics["distill/teacher_kl"] == pytest.approx(-SHIFT, abs=1e-5)


def test_the_group_baseline_takes_a_constant_teacher_offset_out(ray_local, tiny_model):
    """distill.baseline=group: the first test's teacher (favoured sample + SHIFT, the other - SHIFT) with every
    log-prob 5 nats lower, as a student far from its teacher sees it: centred on the other sample's mean, the
    favoured sample still rises and the other falls. Uncentred, both would be pushed down (advantages -4 and -6)."""
    from fully_async.training import build_backend

    trainer = TrainerConfig(n_gpus_per_node=1, max_token_len_per_gpu=512, total_steps=20, lr=1e-2)
    be = build_backend(trainer, AlgorithmConfig(), tiny_model, device="cpu",
                       distill=DistillConfig(enable=True, coef=1.0, baseline="group"))  # fmt: skip
    try:
        groups = make_groups(4, 2, seed=3, response_len=(3, 6))
        trajs = flatten(groups)
        before = be.compute_log_probs(groups)
        for t, lp in zip(trajs, before):
            t.behaviour_logprobs = lp.astype(np.float32)
            sign = 1.0 if t.sample_index == 0 else -1.0
            t.teacher_logprobs = (lp + sign * SHIFT - 5.0).astype(np.float32)
        metrics = be.update(groups, version=0)  # one step: at lr 1e-2 a second one overshoots the teacher
        after = be.compute_log_probs(groups)
    finally:
        be.shutdown()
    moved = [float(np.mean(a - b)) for a, b in zip(after, before)]
    favoured = [m for t, m in zip(trajs, moved) if t.sample_index == 0]
    disfavoured = [m for t, m in zip(trajs, moved) if t.sample_index == 1]
    assert min(favoured) > 0 and max(disfavoured) < 0, (favoured, disfavoured)
    assert metrics["distill/baseline_mean"] == pytest.approx(-5.0, abs=1e-4)  # the groups' +-SHIFT cancel
