"""Step metrics of the reward path: the slowest sample's phases and the per-source counters."""

from __future__ import annotations

from fully_async.metrics import batch_metrics, reward_source_metrics
from tests.helpers import make_group


def test_slowest_sample_reports_its_own_generate_and_reward_times():
    groups = [make_group(0), make_group(1)]
    timings = [(1.0, 0.5), (0.2, 3.0), (2.0, 0.1), (0.1, 0.1)]  # the second is slowest overall (3.2 s)
    for t, (gen, rew) in zip([t for g in groups for t in g.trajectories], timings):
        t.timings.update(generate_s=gen, reward_s=rew)
    m = batch_metrics(groups, trainer_version=0)
    assert m["timing_s/agent_loop/slowest/generate"] == 0.2 and m["timing_s/agent_loop/slowest/reward"] == 3.0
    assert m["timing_s/agent_loop/reward/max"] == 3.0 and m["timing_s/agent_loop/generate/max"] == 2.0


def test_reward_source_metrics_are_per_step_deltas():
    last = {"judge": {"calls": 10, "retries": 1, "latency_s": 5.0, "in_flight": 3, "limiter_wait_s": 2.0,
                      "limiter_acquired": 12, "realized_rpm": 50.0, "realized_tpm": 900.0}}  # fmt: skip
    now = {"judge": {"calls": 14, "retries": 4, "latency_s": 9.0, "in_flight": 2, "limiter_wait_s": 4.0,
                     "limiter_acquired": 16, "realized_rpm": 60.0, "realized_tpm": 1000.0, "timeouts": 1}}  # fmt: skip
    m = reward_source_metrics(now, last)
    p = "fully_async/reward/judge"
    assert m[f"{p}/calls"] == 4 and m[f"{p}/retries"] == 3 and m[f"{p}/timeouts"] == 1
    assert m[f"{p}/latency_s"] == 1.0 and m[f"{p}/limiter_wait_s"] == 0.5
    assert m[f"{p}/in_flight"] == 2 and m[f"{p}/realized_rpm"] == 60.0 and m[f"{p}/realized_tpm"] == 1000.0
    rule = reward_source_metrics({"rule": {"calls": 3, "in_flight": 0}}, {})
    assert "fully_async/reward/rule/limiter_wait_s" not in rule and rule["fully_async/reward/rule/calls"] == 3


def test_multi_turn_metrics_only_for_multi_turn_batches():
    groups = [make_group(0), make_group(1)]
    assert not any(k.startswith(("num_turns", "agent/")) for k in batch_metrics(groups, trainer_version=0))
    infos = [
        {"turns": 1, "tool_calls": 0, "tool_error": False},
        {"turns": 3, "tool_calls": 2, "tool_error": True, "tool_errors/timeout": 1},
        {"turns": 2, "tool_calls": 1, "tool_error": True, "tool_errors/timeout": 1},
        {"turns": 2, "tool_calls": 1, "tool_error": False},
    ]
    for t, info, tool_s in zip([t for g in groups for t in g.trajectories], infos, [0.0, 1.5, 0.5, 0.25]):
        t.reward_info.update(info)
        t.timings["tool_s"] = tool_s
    m = batch_metrics(groups, trainer_version=0)
    assert (m["num_turns/min"], m["num_turns/mean"], m["num_turns/max"]) == (1, 2, 3)
    assert m["agent/tool_calls/mean"] == 1.0 and m["agent/tool_error_ratio"] == 0.5 and m["agent/tool_timeouts"] == 2
    assert m["timing_s/agent_loop/tool_calls/max"] == 1.5 and m["timing_s/agent_loop/tool_calls/mean"] == 0.5625
    assert "agent/env_turns/mean" not in m and "agent/split_rows" not in m
    for t, env in zip([t for g in groups for t in g.trajectories], [0, 1, 2, 1]):
        t.reward_info["env_turns"] = env
        t.timings["env_s"] = 0.5 * env
    m = batch_metrics(groups, trainer_version=0)
    assert m["agent/env_turns/mean"] == 1.0 and m["timing_s/agent_loop/env_turns/max"] == 1.0


def test_agents_that_never_called_the_model_and_the_keys_the_gateway_ignored_are_counted():
    groups = [make_group(0), make_group(1)]
    trajs = [t for g in groups for t in g.trajectories]
    for t, turns in zip(trajs, [0, 2, 2, 0]):
        t.reward_info.update(turns=turns, split_rows=1, split_part=0)
    m = batch_metrics(groups, trainer_version=0)
    assert m["agent/no_calls"] == 2 and "gateway/ignored_keys" not in m  # rollout functions: no gateway
    for t, ignored in zip(trajs, [{}, {"gateway_ignored/temperature": 2}, {"gateway_ignored/stop": 1}, {}]):
        t.reward_info.update(gateway_calls=t.reward_info["turns"], **ignored)
    assert batch_metrics(groups, trainer_version=0)["gateway/ignored_keys"] == 3
    for t in trajs:
        del t.reward_info["split_rows"], t.reward_info["gateway_calls"]
    assert not any(k in batch_metrics(groups, 0) for k in ("agent/no_calls", "gateway/ignored_keys"))  # ToolAgentLoop


def test_trajectory_records_carry_turns_and_tool_calls():
    from fully_async.metrics import trajectory_records

    single, multi = make_group(0), make_group(1)
    multi.trajectories[0].reward_info.update(turns=3, tool_calls=2)
    records = trajectory_records([single, multi], step=1, trainer_version=0)
    assert [(r["turns"], r["tool_calls"]) for r in records] == [(1, 0), (1, 0), (3, 2), (1, 0)]


def test_a_validation_is_drawn_at_the_version_it_graded_not_the_step_that_logged_it():
    from fully_async.metrics import validation_points

    rows = [{"step": 1}, {"step": 2, "val/reward_mean": 0.1, "val/version": 0},
            {"step": 13, "val/reward_mean": 0.5, "val/version": 10}, {"step": 14, "val/reward_mean": 0.6}]  # fmt: skip
    assert validation_points(rows) == [(0, 0.1), (10, 0.5), (14, 0.6)]  # a row without val/version: its step
