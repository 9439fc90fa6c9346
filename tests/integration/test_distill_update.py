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


def distil(tiny_model, seed: int, behave, teacher, steps: int = 1, version: int = 0, lora: bool = False, **distill):
    """A backend with distill.`distill` (coef 1); each trajectory of 4 groups of 2 gets behaviour and teacher
    log-probs `behave(t, lp)` / `teacher(t, lp)` from the student's current `lp`; `steps` updates at `version`.
    Returns (trajectories, each one's mean log-prob change, the last step's metrics)."""
    from fully_async.training import build_backend

    trainer = TrainerConfig(n_gpus_per_node=1, max_token_len_per_gpu=512, total_steps=20, lr=1e-2)
    be = build_backend(trainer, AlgorithmConfig(), tiny_model, device="cpu",
                       lora=LoraConfig(rank=8, alpha=16, lr=3e-2) if lora else None,
                       distill=DistillConfig(enable=True, coef=1.0, **distill))  # fmt: skip
    try:
        groups = make_groups(4, 2, seed=seed, response_len=(3, 6))
        trajs = flatten(groups)
        before = be.compute_log_probs(groups)
        for t, lp in zip(trajs, before):
            t.behaviour_logprobs = behave(t, lp).astype(np.float32)
            t.teacher_logprobs = teacher(t, lp).astype(np.float32)
        for _ in range(steps):
            metrics = be.update(groups, version=version)
        after = be.compute_log_probs(groups)
    finally:
        be.shutdown()
    return trajs, [a - b for a, b in zip(after, before)], metrics


def shifted(t, lp):
    """The teacher of the first test: the student's log-prob + SHIFT on sample 0 of each group, - SHIFT on sample 1."""
    return lp + (SHIFT if t.sample_index == 0 else -SHIFT)


def split(trajs, moved):
    """(the favoured samples' mean changes, the disfavoured ones')."""
    means = [float(np.mean(m)) for m in moved]
    return [m for t, m in zip(trajs, means) if t.sample_index == 0], [m for t, m in zip(trajs, means) if t.sample_index]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_pure_distillation_moves_the_student_toward_the_teacher(ray_local, tiny_model, lora):
    # on-policy: sampled by the student as it is
    trajs, moved, metrics = distil(tiny_model, 3, lambda t, lp: lp, shifted, steps=3, lora=lora)
    assert metrics["distill/tokens"] == sum(t.response_length for t in trajs)
    favoured, disfavoured = split(trajs, moved)
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
    _, moved, metrics = distil(tiny_model, 5, lambda t, lp: lp - SHIFT, lambda t, lp: lp, version=2)
    assert abs(metrics["distill/advantage_mean"]) < 1e-4, metrics["distill/advantage_mean"]
    assert max(float(np.abs(m).max()) for m in moved) < 1e-3
    # The KL metric describes the sampled policy: mean(behave - teacher) = -SHIFT.
    assert metrics["distill/teacher_kl"] == pytest.approx(-SHIFT, abs=1e-5)


def test_the_group_baseline_takes_a_constant_teacher_offset_out(ray_local, tiny_model):
    """distill.baseline=group: the first test's teacher with every log-prob 5 nats lower, as a student far from its
    teacher sees it: centred on the other sample's mean, the favoured sample still rises and the other falls in one
    step (at lr 1e-2 a second overshoots the teacher). Uncentred, both would be pushed down (advantages -4, -6)."""
    trajs, moved, metrics = distil(tiny_model, 3, lambda t, lp: lp, lambda t, lp: shifted(t, lp) - 5.0,
                                   baseline="group")  # fmt: skip
    favoured, disfavoured = split(trajs, moved)
    assert min(favoured) > 0 and max(disfavoured) < 0, (favoured, disfavoured)
    assert metrics["distill/baseline_mean"] == pytest.approx(-5.0, abs=1e-4)  # the groups' +-SHIFT cancel
