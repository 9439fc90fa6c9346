"""Batch assembly, data-parallel row layout, advantages and importance weights against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_async.config import AlgorithmConfig
from fully_async.protocol import NO_VERSION, PromptRef, Trajectory, TrajectoryGroup
from fully_async.training import batch as B
from tests.training_data import make_groups


def _traj(index: int, sample: int, prompt, response, reward=0.0, loss_mask=None, versions=None):
    n = len(response)
    return Trajectory(
        prompt=PromptRef(0, index),
        sample_index=sample,
        prompt_ids=np.array(prompt),
        response_ids=np.array(response),
        behaviour_logprobs=-np.arange(1, n + 1, dtype=np.float32),
        token_versions=np.zeros(n) if versions is None else np.array(versions),
        loss_mask=loss_mask,
        reward=reward,
    )


def test_assemble_pads_prompts_left_and_responses_right():
    g0 = TrajectoryGroup(PromptRef(0, 0), [_traj(0, 0, [5, 6, 7], [8, 9]), _traj(0, 1, [5, 6, 7], [10])])
    g1 = TrajectoryGroup(PromptRef(0, 1), [_traj(1, 0, [4], [11, 12, 13], loss_mask=[1, 0, 1], versions=[2, -1, 3])])
    b = B.assemble([g0, g1], pad_token_id=0)
    assert b.prompts.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 4]]
    assert b.responses.tolist() == [[8, 9, 0], [10, 0, 0], [11, 12, 13]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 1]]
    assert b.position_ids[2].tolist() == [0, 0, 0, 1, 2, 3]
    assert b.token_versions[2].tolist() == [2, NO_VERSION, 3]
    assert b.behaviour_logprobs[0].tolist() == [-1.0, -2.0, 0.0]
    assert list(b.group_index) == ["0:0", "0:0", "0:1"]
    assert b.response_lengths.tolist() == [2, 1, 3]


def test_assemble_lays_out_kv_cache_versions_only_when_a_trajectory_has_them():
    plain = TrajectoryGroup(PromptRef(0, 0), [_traj(0, 0, [5], [8, 9], versions=[3, 4])])
    assert B.assemble([plain]).cache_versions is None
    kept = _traj(1, 0, [4], [11, 12, 13], loss_mask=[1, 0, 1], versions=[3, -1, 4])
    kept.cache_versions = np.array([3, -1, 3], dtype=np.int32)
    b = B.assemble([plain, TrajectoryGroup(PromptRef(0, 1), [kept])])
    assert b.cache_versions.tolist() == [[3, 4, NO_VERSION], [3, NO_VERSION, 3]]  # a row without: its own versions
    assert b.select(np.array([1, -1])).cache_versions.tolist() == [[3, NO_VERSION, 3], [NO_VERSION] * 3]


def test_empty_response_keeps_one_masked_slot():
    b = B.assemble([TrajectoryGroup(PromptRef(0, 0), [_traj(0, 0, [1, 2], [])])])
    assert b.responses.shape == (1, 1)
    assert b.response_mask.sum() == 0
    assert b.response_lengths.tolist() == [0]


def test_padding_rows_are_inert():
    b = B.assemble(make_groups(2, 2, seed=1))
    p = b.select(np.array([3, -1, 0]))
    assert p.source.tolist() == [3, -1, 0]
    assert p.response_mask[1].sum() == 0 and p.rewards[1] == 0
    assert p.attention_mask[1].sum() == 2  # one prompt token + one response token
    assert torch.equal(p.responses[0], b.responses[3])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 5))
def test_dp_layout_places_every_row_once_and_fills_every_mini_batch(num_real, dp, mini):
    rows, used = B.dp_layout(num_real, dp, mini)
    assert 1 <= used <= mini
    assert len(rows) % (dp * used) == 0
    assert sorted(rows[rows >= 0].tolist()) == list(range(num_real))
    per_rank = len(rows) // dp
    per_mini = per_rank // used
    for m in range(used):  # global mini-batch m = block m of every rank's chunk
        block = np.concatenate(
            [rows[r * per_rank + m * per_mini : r * per_rank + (m + 1) * per_mini] for r in range(dp)]
        )
        assert (block >= 0).any()


def _outcome_batch(rewards_by_group):
    groups = []
    for g, rewards in enumerate(rewards_by_group):
        groups.append(
            TrajectoryGroup(PromptRef(0, g), [_traj(g, s, [1], [2, 3, 4], reward=r) for s, r in enumerate(rewards)])
        )
    return B.assemble(groups)


def test_grpo_matches_hand_computation():
    b = _outcome_batch([[1.0, 0.0, 0.0, 1.0], [2.0, 5.0]])
    adv = B.compute_advantages(b, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std=True))
    r0 = np.array([1.0, 0.0, 0.0, 1.0])
    want0 = (r0 - r0.mean()) / (r0.std(ddof=1) + 1e-6)
    r1 = np.array([2.0, 5.0])
    want1 = (r1 - r1.mean()) / (r1.std(ddof=1) + 1e-6)
    want = np.concatenate([want0, want1])
    np.testing.assert_allclose(adv[:, 0].numpy(), want, rtol=1e-5)
    assert torch.equal(adv[:, 0:1].expand(-1, 3), adv)  # the same advantage on every response token
    adv_nostd = B.compute_advantages(b, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std=False))
    np.testing.assert_allclose(adv_nostd[:, 0].numpy(), np.concatenate([r0 - r0.mean(), r1 - r1.mean()]), rtol=1e-6)


def test_rloo_matches_hand_computation():
    b = _outcome_batch([[1.0, 0.0, 3.0]])
    adv = B.compute_advantages(b, AlgorithmConfig(adv_estimator="rloo"))
    r = np.array([1.0, 0.0, 3.0])
    want = [r[i] - np.delete(r, i).mean() for i in range(3)]
    np.testing.assert_allclose(adv[:, 0].numpy(), want, rtol=1e-5)


def test_reinforce_plus_plus_whitens_returns_over_the_batch():
    b = _outcome_batch([[1.0, 0.0], [3.0]])
    adv = B.compute_advantages(b, AlgorithmConfig(adv_estimator="reinforce_plus_plus"))
    # gamma = 1: every token's return is the trajectory reward; whitening is over all loss tokens of the batch.
    returns = np.repeat([1.0, 0.0, 3.0], 3)
    mean, var = returns.mean(), returns.var(ddof=1)
    want = (returns - mean) / math.sqrt(var + 1e-8)
    np.testing.assert_allclose(adv.flatten().numpy(), want, rtol=1e-4)


def test_advantages_are_zero_off_the_loss_mask():
    g = TrajectoryGroup(
        PromptRef(0, 0), [_traj(0, 0, [1], [2, 3], reward=1.0, loss_mask=[0, 1]), _traj(0, 1, [1], [2], reward=0.0)]
    )
    adv = B.compute_advantages(B.assemble([g]), AlgorithmConfig())
    assert adv[0, 0] == 0 and adv[0, 1] > 0 and adv[1, 1] == 0


def test_an_estimator_without_the_inputs_it_needs_is_a_clear_error():
    with pytest.raises(ValueError, match="optimal_token_baseline needs old_log_probs"):
        B.compute_advantages(_outcome_batch([[1.0, 0.0]]), AlgorithmConfig(adv_estimator="optimal_token_baseline"))
    with pytest.raises(ValueError, match="gdpo needs its reward components"):
        B.compute_advantages(_outcome_batch([[1.0, 0.0]]), AlgorithmConfig(adv_estimator="gdpo"))


def test_gdpo_reads_reward_components_from_the_function_output_or_a_source_score():
    def traj(i, info):
        t = _traj(0, i, [1], [2], reward=0.0)
        t.reward_info = info
        return t

    g = TrajectoryGroup(PromptRef(0, 0), [traj(0, {"acc": 1.0, "sources": {"fmt": {"score": 0.5}}}),
                                          traj(1, {"acc": 0.0, "sources": {"fmt": {"score": 1.0}}})])  # fmt: skip
    comps = B.reward_components([g], ["acc", "fmt"])
    np.testing.assert_array_equal(comps["acc"], [1.0, 0.0])
    np.testing.assert_array_equal(comps["fmt"], [0.5, 1.0])
    with pytest.raises(ValueError, match="'len' is neither"):
        B.reward_components([g], ["len"])


def test_engine_tensordict_keeps_response_mask_as_loss_mask():
    b = B.assemble(make_groups(2, 2, seed=3))
    td = B.to_engine_td(b, temperature=0.7, advantages=torch.ones(b.responses.shape))
    assert td["input_ids"].is_nested
    assert int(td["loss_mask"].sum()) == int(b.response_mask.sum())
    assert td["input_ids"].offsets().diff().tolist() == b.attention_mask.sum(-1).tolist()


def test_version_metrics_measure_token_lag():
    g = TrajectoryGroup(PromptRef(0, 0), [_traj(0, 0, [1], [2, 3, 4], versions=[1, 2, -1], loss_mask=[1, 1, 1])])
    m = B.version_metrics(B.assemble([g]), trainer_version=3)
    assert m == {"staleness/token_mean": 1.5, "staleness/token_max": 2.0}


def _hand_gae(rewards, values, mask, gamma, lam):
    """GAE written out for one trajectory: loss tokens only (a masked token is skipped, its reward kept for the next
    loss token to its left), reward on the last response token, V = 0 past the end."""
    n = len(values)
    adv, nxt_v, nxt_a = [0.0] * n, 0.0, 0.0
    pending = 0.0  # reward on skipped tokens, carried to the loss token before them
    for t in reversed(range(n)):
        if not mask[t]:
            pending += rewards[t]
            continue
        delta = rewards[t] + pending + gamma * nxt_v - values[t]
        nxt_a = delta + gamma * lam * nxt_a
        adv[t], nxt_v, pending = nxt_a, values[t], 0.0
    return adv


def test_gae_advantages_and_returns_equal_a_hand_computation():
    g0 = TrajectoryGroup(PromptRef(0, 0), [_traj(0, 0, [5, 6], [8, 9, 10], reward=1.0),
                                           _traj(0, 1, [5, 6], [11], reward=-0.5)])  # fmt: skip
    g1 = TrajectoryGroup(PromptRef(0, 1), [_traj(1, 0, [4], [12, 13, 14, 15], reward=2.0, loss_mask=[1, 0, 1, 0])])
    b = B.assemble([g0, g1])
    # Row 2 ends in a tool token: its reward counts at the last loss token. 9 and 7: off the mask.
    values = torch.tensor([[0.3, -0.2, 0.5, 9.0], [0.1, 9.0, 9.0, 9.0], [0.4, 7.0, -0.6, 7.0]])
    gamma, lam = 0.9, 0.8
    adv, returns = B.gae(b, values, gamma, lam)
    mask = b.response_mask.bool()
    raw = []
    for i, (length, reward) in enumerate([(3, 1.0), (1, -0.5), (4, 2.0)]):
        rewards = [0.0] * length
        rewards[-1] = reward
        raw.append(_hand_gae(rewards, values[i, :length].tolist(), mask[i, :length].tolist(), gamma, lam))
    for i, row in enumerate(raw):
        for t, a in enumerate(row):
            if mask[i, t]:
                assert returns[i, t].item() == pytest.approx(a + values[i, t].item(), abs=1e-6), (i, t)
    flat = torch.tensor([a for i, row in enumerate(raw) for t, a in enumerate(row) if mask[i, t]], dtype=torch.float64)
    whitened = (flat - flat.mean()) / torch.sqrt(flat.var(unbiased=True) + 1e-8)  # verl whitens over loss tokens
    assert adv[mask].double().tolist() == pytest.approx(whitened.tolist(), abs=1e-5)
    assert not adv[~mask].any() and not returns[~mask].any()


def test_value_metrics_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    perfect = B.value_metrics(returns.clone(), returns, mask)
    assert perfect["critic/vf_explained_var"] == pytest.approx(1.0) and perfect["critic/value_mse"] == 0.0
    mean_only = B.value_metrics(torch.full_like(returns, 2.0), returns, mask)
    assert mean_only["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-6)
    assert mean_only["critic/value_mse"] == pytest.approx(2 / 3)
    constant = B.value_metrics(torch.tensor([[0.5, 0.1, 0.0, 0.0]]), torch.zeros((1, 4)), mask)
    assert "critic/vf_explained_var" not in constant and constant["critic/value_mse"] == pytest.approx(0.26 / 3)


def test_rows_split_off_a_sample_share_its_advantage_and_count_once_in_the_baseline():
    # Sample 0 of the group was split into two rows (agents/rollout_fn.py); the baseline is over samples 0 and 1.
    rows = [_traj(0, 0, [1], [2, 3], reward=1.0), _traj(0, 0, [1], [4, 5, 6], reward=1.0, loss_mask=[0, 1, 1]),
            _traj(0, 1, [1], [7], reward=0.0)]  # fmt: skip
    groups = [TrajectoryGroup(PromptRef(0, 0), rows)]
    owners = B.sample_owners(groups)
    assert owners.tolist() == [1, 1, 2]
    algo = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std=False)
    adv = B.compute_advantages(B.assemble(groups), algo, owners=owners)
    assert adv[1, 1:3].tolist() == [0.5, 0.5] and adv[1, 0] == 0  # (1 - 0.5): two samples, not three rows
    assert adv[0, :2].tolist() == [0.5, 0.5] and adv[0, 2] == 0  # the split row: its owner's, on its own mask
    assert adv[2, 0] == -0.5
