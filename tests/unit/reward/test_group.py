"""reward.group_fn: the whole group after per-sample scoring, its timeout and failure policies, info kept."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fully_async.config import ConfigError, RewardConfig, RewardSourceConfig, compose
from fully_async.reward import RewardAgent, RewardDrop, RewardFatal
from fully_async.reward.shaping import overlong_penalty
from tests.helpers import make_group

META = {"data_source": "fully_async/synthetic", "ground_truth": "7", "extra_info": {}, "question": "echo 7"}


@pytest.fixture
def agent_factory():
    made = []

    def make(fn, **kw):
        a = RewardAgent(RewardConfig([RewardSourceConfig(timeout_s=5.0)], num_workers=1, group_fn=fn, **kw))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def scored_group(lengths=(5, 2, 8, 3)):
    """A group whose samples have the given response lengths, per-sample scores 0/1 and per-sample reward info."""
    group = make_group(0, n=len(lengths))
    for t, n in zip(group.trajectories, lengths):
        t.response_ids = np.full(n, 7)
        t.behaviour_logprobs = np.zeros(n, dtype=np.float32)
        t.token_versions = np.zeros(n, dtype=np.int64)
        t.loss_mask = np.ones(n, dtype=np.int64)
        t.reward_info = {"sources": {"rule": {"score": t.reward}}, "acc": t.reward}
    return group.trajectories


async def test_a_ranking_function_sees_the_whole_group_and_per_sample_info_is_kept(agent_factory):
    agent = agent_factory("tests.fakes:rank_group")
    trajs = scored_group()
    before = [t.reward for t in trajs]
    await agent.group.apply(trajs, ["a"] * 4, META, "0:0")
    assert [t.reward for t in trajs] == [2 / 3, 0.0, 1.0, 1 / 3]  # ranks by length over all four samples
    for t, b in zip(trajs, before):
        assert t.reward_info["sample_score"] == b and t.reward_info["acc"] == b  # the per-sample scoring stays
        assert t.reward_info["sources"]["rule"]["score"] == b
        info = t.reward_info["group_fn"]
        assert info["group_size"] == 4 and info["uid"] == "0:0" and info["latency_s"] > 0
    stats = agent.stats()["group_fn"]
    assert stats["calls"] == 1 and stats["failures"] == 0 and stats["latency_s"] > 0


async def test_an_async_function_runs_on_the_loop_with_one_info_for_the_group(agent_factory):
    agent = agent_factory("tests.fakes:async_mean_group")
    assert agent.group.is_async
    trajs = scored_group()
    await agent.group.apply(trajs, ["a"] * 4, META, "0:0")
    assert [t.reward for t in trajs] == [0.5] * 4
    assert all(t.reward_info["group_fn"]["mean"] == 0.5 for t in trajs)


@pytest.mark.parametrize("fn", ["tests.fakes:slow_group", "tests.fakes:async_mean_group"])
async def test_a_slow_function_is_cut_at_its_timeout_and_the_scores_kept(agent_factory, fn):
    agent = agent_factory(fn, group_fn_timeout_s=0.5)
    trajs = scored_group()
    before = [t.reward for t in trajs]
    start = time.monotonic()
    await agent.group.apply(trajs, ["a"] * 4, {**META, "extra_info": {"sleep": 30}}, "0:0")
    assert time.monotonic() - start < 10
    assert [t.reward for t in trajs] == before
    assert all(t.reward_info["group_fn"]["failed"] and "timeout" in t.reward_info["group_fn"]["error"] for t in trajs)
    assert agent.stats()["group_fn"]["timeouts"] == 1 and agent.stats()["group_fn"]["fallbacks"] == 1


async def test_drop_reissues_and_raise_fails_the_run(agent_factory):
    dropping = agent_factory("tests.fakes:wrong_size_group", group_fn_on_failure="drop")
    with pytest.raises(RewardDrop, match="one reward per sample"):
        await dropping.group.apply(scored_group(), ["a"] * 4, META, "0:0")
    assert dropping.stats()["group_fn"]["drops"] == 1
    raising = agent_factory("tests.fakes:wrong_size_group", group_fn_on_failure="raise")
    with pytest.raises(RewardFatal, match="group_fn_on_failure=raise"):
        await raising.group.apply(scored_group(), ["a"] * 4, META, "0:0")


def test_group_fn_config_is_checked():
    with pytest.raises(ConfigError, match="reward.group_fn must be a dotted path"):
        compose(["reward.group_fn=not_a_path"])
    with pytest.raises(ConfigError, match="reward.group_fn_timeout_s must be > 0"):
        compose(["reward.group_fn=tests.fakes:rank_group", "reward.group_fn_timeout_s=0"])
    with pytest.raises(ConfigError, match="names reward.group_fn's metrics"):
        compose(["reward.sources=[{kind: rule, name: group_fn}]"])
    with pytest.raises(ConfigError, match="reward.overlong_buffer must be <= rollout.response_length"):
        compose(["reward.overlong_buffer=33"])


def test_overlong_penalty_ramps_over_the_buffer():
    assert overlong_penalty(20, 32, 8, 1.0) == 0.0
    assert overlong_penalty(24, 32, 8, 1.0) == 0.0
    assert overlong_penalty(28, 32, 8, 1.0) == -0.5
    assert overlong_penalty(32, 32, 8, 0.5) == -0.5
    assert overlong_penalty(40, 32, 8, 1.0) == -1.0
    assert overlong_penalty(40, 32, 0, 1.0) == 0.0


def test_dynamic_sampling_compares_the_reward_or_a_reward_info_key():
    from fully_async.reward.shaping import group_values, is_constant

    trajs = scored_group()  # rewards 0, 1, 0, 1 and acc the same
    assert group_values(trajs, "reward") == [0.0, 1.0, 0.0, 1.0] and not is_constant(group_values(trajs, "reward"))
    for t in trajs:
        t.reward_info["acc"] = 1.0
    assert is_constant(group_values(trajs, "acc"))
    assert group_values(trajs, "missing") is None
    assert is_constant([0.5, 0.5, 0.5]) and not is_constant([0.5, 0.5, 0.5 + 1e-6])
