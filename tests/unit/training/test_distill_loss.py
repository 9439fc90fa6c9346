"""On-policy distillation's per-token advantage (training/distill_loss.py) against hand computations, its mix with
GRPO's group advantage, and the teacher log-probs' way through batch assembly and the group encoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fully_async.config import AlgorithmConfig
from fully_async.protocol import NO_VERSION, PromptRef, Trajectory, TrajectoryGroup, decode_groups, encode_groups
from fully_async.training import batch as B
from fully_async.training import distill_loss as D


def _traj(sample: int, behave, teacher, reward=0.0, loss_mask=None, versions=None, index: int = 0):
    n = len(behave)
    return Trajectory(
        prompt=PromptRef(0, index),
        sample_index=sample,
        prompt_ids=np.array([5, 6]),
        response_ids=np.arange(10, 10 + n),
        behaviour_logprobs=np.array(behave, dtype=np.float32),
        token_versions=np.zeros(n) if versions is None else np.array(versions),
        loss_mask=loss_mask,
        reward=reward,
        teacher_logprobs=None if teacher is None else np.array(teacher, dtype=np.float32),
    )


def test_per_token_advantage_is_teacher_minus_student_by_hand():
    # A multi-turn sample: token 2 is tool output (mask 0), so it carries no teacher signal.
    t = _traj(0, behave=[-1.0, -2.0, -0.5, -3.0], teacher=[-0.5, -2.5, -9.0, -1.0], loss_mask=[1, 1, 0, 1])
    b = B.assemble([TrajectoryGroup(t.prompt, [t])])
    adv = D.teacher_advantages(b.teacher_logprobs, b.behaviour_logprobs, b.response_mask)
    assert adv[0].tolist() == pytest.approx([0.5, -0.5, 0.0, 2.0])


def test_discount_sums_later_loss_tokens_and_bridges_tool_tokens_by_hand():
    t = _traj(0, behave=[-1.0, -2.0, -0.5, -3.0], teacher=[-0.5, -2.5, -9.0, -1.0], loss_mask=[1, 1, 0, 1])
    b = B.assemble([TrajectoryGroup(t.prompt, [t])])
    adv = D.teacher_advantages(b.teacher_logprobs, b.behaviour_logprobs, b.response_mask, discount=0.5)
    # r = [0.5, -0.5, (tool), 2.0]: A3 = 2.0; A1 = -0.5 + 0.5 * 2.0 = 0.5; A0 = 0.5 + 0.5 * 0.5 = 0.75
    assert adv[0].tolist() == pytest.approx([0.75, 0.5, 0.0, 2.0])


def test_coef_mixes_with_grpo_group_advantage_by_hand():
    # One group of two one-token samples, rewards 1 and 0: GRPO gives (r - mean) / std(ddof=1) = +-0.5 / 0.7071.
    g = TrajectoryGroup(PromptRef(0, 0), [_traj(0, [-1.0], [-0.2], reward=1.0), _traj(1, [-0.3], [-1.3], reward=0.0)])
    b = B.assemble([g])
    task = B.compute_advantages(b, AlgorithmConfig(adv_estimator="grpo"))
    grpo = 0.5 / np.std([1.0, 0.0], ddof=1)
    assert task[:, 0].tolist() == pytest.approx([grpo, -grpo], abs=1e-4)
    adv, metrics = D.distill_advantages(task, b.teacher_logprobs, b.behaviour_logprobs, b.response_mask,
                                        b.token_versions, coef=0.25, discount=0.0, trainer_version=0)  # fmt: skip
    # teacher signal: 0.8 and -1.0
    assert adv[:, 0].tolist() == pytest.approx([0.25 * 0.8 + 0.75 * grpo, 0.25 * -1.0 - 0.75 * grpo], abs=1e-4)
    pure, _ = D.distill_advantages(task, b.teacher_logprobs, b.behaviour_logprobs, b.response_mask,
                                   b.token_versions, coef=1.0, discount=0.0)  # fmt: skip
    assert pure[:, 0].tolist() == pytest.approx([0.8, -1.0])
    # reverse KL per token (behave - teacher), mean over the 2 loss tokens: (-0.8 + 1.0) / 2
    assert metrics["distill/teacher_kl"] == pytest.approx(0.1)
    assert metrics["distill/staleness_0/teacher_kl"] == pytest.approx(0.1)


def test_signal_is_taken_against_the_proximal_log_probs_and_metrics_against_behaviour():
    g = TrajectoryGroup(PromptRef(0, 0), [_traj(0, [-3.0, -1.0], [-0.5, -2.0], versions=[1, 1])])
    b = B.assemble([g])
    prox = torch.tensor([[-1.0, -1.5]])
    adv, metrics = D.distill_advantages(torch.zeros(1, 2), b.teacher_logprobs, b.behaviour_logprobs, b.response_mask,
                                        b.token_versions, coef=1.0, discount=0.0, trainer_version=3, student=prox)  # fmt: skip
    assert adv[0].tolist() == pytest.approx([0.5, -0.5])  # teacher - prox, not teacher - behave (2.5, -1.0)
    # the sampled policy's reverse KL: mean(behave - teacher) = (-2.5 + 1.0) / 2, in the staleness-2 bucket
    assert metrics["distill/teacher_kl"] == pytest.approx(-0.75)
    assert metrics["distill/staleness_2/teacher_kl"] == pytest.approx(-0.75)
    bypass, _ = D.distill_advantages(torch.zeros(1, 2), b.teacher_logprobs, b.behaviour_logprobs, b.response_mask,
                                     b.token_versions, coef=1.0, discount=0.0)  # fmt: skip
    assert bypass[0].tolist() == pytest.approx([2.5, -1.0])  # no proximal pass: the behaviour log-probs stand in


def test_group_baseline_is_the_other_samples_mean_signal_by_hand():
    # Group A: three samples; sample 0 split into two rows (one sample: its mean over both rows' loss tokens);
    # group B: one sample (no other sample, baseline 0).
    a0a = _traj(0, behave=[-1.0, -1.0], teacher=[-2.0, -4.0], index=0)  # r = -1, -3
    a0b = _traj(0, behave=[-1.0], teacher=[0.0], index=0)  # r = 1; sample 0's mean: (-1 - 3 + 1) / 3 = -1
    a1 = _traj(1, behave=[-2.0], teacher=[-1.0], index=0)  # r = 1
    a2 = _traj(2, behave=[-1.0, -1.0], teacher=[-1.0, -5.0], loss_mask=[1, 0], index=0)  # r = 0 (tool token off)
    b0 = _traj(0, behave=[-1.0], teacher=[-3.0], index=1)  # r = -2
    groups = [TrajectoryGroup(PromptRef(0, 0), [a0a, a0b, a1, a2]), TrajectoryGroup(PromptRef(0, 1), [b0])]
    b = B.assemble(groups)
    owners = B.sample_owners(groups)
    base = D.group_baseline(D.teacher_signal(b.teacher_logprobs, b.behaviour_logprobs, b.response_mask),
                            b.response_mask, b.group_index, owners)  # fmt: skip
    # sample 0: mean(1, 0) = 0.5; sample 1: mean(-1, 0) = -0.5; sample 2: mean(-1, 1) = 0; group B: 0
    assert base.tolist() == pytest.approx([0.5, 0.5, -0.5, 0.0, 0.0])
    adv, metrics = D.distill_advantages(torch.zeros(5, 2), b.teacher_logprobs, b.behaviour_logprobs, b.response_mask,
                                        b.token_versions, 1.0, 0.0, groups=(b.group_index, owners))  # fmt: skip
    assert adv[:, :2].flatten().tolist() == pytest.approx([-1.5, -3.5, 0.5, 0.0, 1.5, 0.0, 0.0, 0.0, -2.0, 0.0])
    assert metrics["distill/baseline_mean"] == pytest.approx(0.1)


def test_with_a_discount_the_group_baseline_is_taken_once_from_each_discounted_sum_by_hand():
    s0 = _traj(0, behave=[-1.0, -1.0], teacher=[0.0, 2.0])  # r = 1, 3 (mean 2)
    s1 = _traj(1, behave=[-1.0, -1.0], teacher=[-1.0, -3.0])  # r = 0, -2 (mean -1)
    groups = [TrajectoryGroup(PromptRef(0, 0), [s0, s1])]
    b = B.assemble(groups)
    adv, _ = D.distill_advantages(torch.zeros(2, 2), b.teacher_logprobs, b.behaviour_logprobs, b.response_mask,
                                  b.token_versions, 1.0, 0.5, groups=(b.group_index, B.sample_owners(groups)))  # fmt: skip
    # baselines: s0 -> -1, s1 -> 2; discounted sums [1 + 0.5 x 3, 3] and [0 + 0.5 x -2, -2], each less its baseline
    assert adv.flatten().tolist() == pytest.approx([3.5, 4.0, -3.0, -4.0])


def test_teacher_kl_by_staleness_bucket():
    t = _traj(0, behave=[-1.0, -1.0, -1.0], teacher=[-1.0, -2.0, -4.0], versions=[3, 2, NO_VERSION],
              loss_mask=[1, 1, 1])  # fmt: skip
    b = B.assemble([TrajectoryGroup(t.prompt, [t])])
    m = D.teacher_metrics(b.teacher_logprobs, b.behaviour_logprobs, b.response_mask, b.token_versions, 3)
    assert m["distill/staleness_0/teacher_kl"] == pytest.approx(0.0)
    assert m["distill/staleness_1/teacher_kl"] == pytest.approx(1.0)
    assert m["distill/teacher_kl"] == pytest.approx(4.0 / 3)  # the unversioned token counts overall only


def test_a_batch_without_teacher_log_probs_is_refused():
    g = TrajectoryGroup(PromptRef(0, 0), [_traj(0, [-1.0], [-0.2]), _traj(1, [-1.0], None)])
    with pytest.raises(ValueError, match="no teacher log-probs"):
        B.assemble([g])
    plain = B.assemble([TrajectoryGroup(PromptRef(0, 0), [_traj(0, [-1.0], None)])])
    assert plain.teacher_logprobs is None
    with pytest.raises(ValueError, match="never scored"):
        D.distill_advantages(torch.zeros(1, 1), None, plain.behaviour_logprobs, plain.response_mask,
                             plain.token_versions, 1.0, 0.0)  # fmt: skip


def test_padding_rows_carry_no_teacher_signal():
    g = TrajectoryGroup(PromptRef(0, 0), [_traj(0, [-1.0, -2.0], [-0.5, -0.5])])
    laid = B.assemble([g]).select(np.array([0, -1]))
    assert laid.teacher_logprobs.tolist() == [[-0.5, -0.5], [0.0, 0.0]]
    adv = D.teacher_advantages(laid.teacher_logprobs, laid.behaviour_logprobs, laid.response_mask)
    assert adv[1].abs().sum() == 0


def test_teacher_log_probs_survive_the_group_encoding():
    g = TrajectoryGroup(PromptRef(0, 0), [_traj(0, [-1.0, -2.0], [-0.25, -3.5]), _traj(1, [-1.0], None)])
    back = decode_groups(encode_groups([g]))[0]
    assert back.trajectories[0].teacher_logprobs.tolist() == [-0.25, -3.5]
    assert back.trajectories[1].teacher_logprobs is None
    assert back.same_as(g)
