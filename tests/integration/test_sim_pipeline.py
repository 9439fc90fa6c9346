"""Small simulated pipelines (engine=sim, trainer=sim) with the real Rollouter, MessageQueue, ledger, ParamSync and
Trainer on local Ray: the staleness bound holds in trajectories.jsonl, partial rollout really carries samples across
versions, a draining sync aborts nothing, and throughput stays above a loose floor of the analytic bound.

A run's fixed cost (the rollouter's actor, its tokenizer import, the shutdown: ~8 s here) exceeds a short schedule's
steps, so tests whose properties do not depend on each other's options read one run (a module fixture): the start-up
and shutdown record comes from the fully async run, group_fn's rescoring from the draining run."""

from __future__ import annotations

import json

import pytest

from fully_async.config import compose
from fully_async.models import resolve_model_path
from fully_async.simulation import capacity, run_schedule, summarize
from fully_async.trace import load

pytestmark = pytest.mark.timeout(300)

SMALL = [
    "engine=sim",
    "trainer=sim",
    "rollout.agent_loop=fully_async.agents.sim:SimAgentLoop",
    "reward.sources=[{kind: 'fully_async.reward.sim:score'}]",
    "rollout.n=4",
    "rollout.response_length=256",
    "rollout.max_concurrent=64",
    "engine.max_model_len=512",
    "engine.num_servers=4",
    "engine.sim.length_median=30",
    "engine.sim.length_sigma=0.8",
    "engine.sim.decode_step_s=0.005",
    "engine.sim.decode_step_per_seq_s=0.0005",
    "async_training.groups_per_step=4",
    "async_training.sync_every=2",
    "trainer.total_steps=8",
    "trainer.sim.train_tokens_per_s_per_gpu=5000",
    "trainer.sim.optimizer_step_s=0.2",
]
PROMPT_TOKENS = 25  # the built-in task's chat-templated prompts


def trajectories(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]


def _run(tmp_path_factory, name: str, overrides: list[str]):
    cfg = compose([*SMALL, *overrides])
    run_dir = tmp_path_factory.mktemp(name)
    run_schedule(cfg, run_dir, str(resolve_model_path(cfg.model)))
    return cfg, run_dir


@pytest.fixture(scope="module")
def fully_async_run(ray_local, tmp_path_factory):
    """8 steps, max_staleness 1, partial rollout: also the start-up and shutdown test's run."""
    overrides = ["async_training.max_staleness=1", "async_training.partial_rollout=true"]
    return _run(tmp_path_factory, "fully-async", overrides)


@pytest.fixture(scope="module")
def draining_run(ray_local, tmp_path_factory):
    """8 steps, one step off with a draining sync, and reward.group_fn (it only rescores finished groups)."""
    overrides = ["async_training.max_staleness=1", "async_training.drain_on_sync=true",
                 "reward.group_fn=tests.fakes:rank_group"]  # fmt: skip
    return _run(tmp_path_factory, "draining", overrides)


def test_fully_async_holds_the_bound_carries_partial_samples_and_keeps_up(fully_async_run):
    cfg, run_dir = fully_async_run
    trajs = trajectories(run_dir)
    assert len(trajs) == 8 * 4 * 4
    assert max(t["trained_version"] - t["min_version"] for t in trajs) <= 1
    assert max(t["response_length"] for t in trajs) <= 256
    assert any(t["max_version"] > t["min_version"] for t in trajs)  # tokens of two versions in one sample
    summary = summarize(run_dir, cfg)
    bound = capacity(cfg, PROMPT_TOKENS, mean_len=summary["trained_length_steady"])["bound"]
    assert summary["samples_per_s_steady"] / bound > 0.5, (summary, bound)


def test_one_step_off_drains_instead_of_aborting(draining_run):
    _, run_dir = draining_run
    trajs = trajectories(run_dir)
    assert len(trajs) == 8 * 4 * 4
    assert all(t["num_aborts"] == 0 and t["max_version"] == t["min_version"] for t in trajs)
    assert max(t["trained_version"] - t["min_version"] for t in trajs) <= 1
    assert any(t["trained_version"] - t["min_version"] == 1 for t in trajs)  # it did overlap with training


def _first_batch(ray, tmp_path, start_concurrent: int) -> tuple[float, int, int]:
    """Start a Rollouter whose staleness bound admits 64 groups at once on engines that slow down steeply with
    concurrency; return the wall seconds until the first trainer step's groups were pushed, the most groups seen
    generating before that, and after it."""
    import time

    from fully_async.message_queue import create_message_queue
    from fully_async.rollouter import create_rollouter

    cfg = compose(
        [
            *SMALL,
            "engine.sim.length_sigma=0",  # every sample 40 tokens: without the window all 64 groups finish together
            "engine.sim.length_median=40",
            "engine.sim.decode_step_s=0.001",
            "engine.sim.decode_step_per_seq_s=0.002",
            "rollout.max_concurrent=256",
            f"rollout.start_concurrent={start_concurrent}",
            "async_training.max_staleness=3",
            "async_training.sync_every=4",
        ]
    )
    at, n = cfg.async_training, cfg.rollout.n
    queue = create_message_queue(at.effective_queue_capacity(), at.max_staleness)
    rollouter = create_rollouter(cfg, str(resolve_model_path(cfg.model)), str(tmp_path), queue)
    try:
        ray.get(rollouter.start.remote(), timeout=120)
        start, before, after = time.monotonic(), 0, 0
        while True:
            s = ray.get(rollouter.stats.remote())
            if s["groups_pushed"] >= at.groups_per_step:
                break
            before = max(before, s["ledger/running"])
            assert time.monotonic() - start < 60, s
            time.sleep(0.02)
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 30
        while (
            start_concurrent < cfg.rollout.max_concurrent
            and after <= start_concurrent // n
            and time.monotonic() < deadline
        ):
            after = max(after, ray.get(rollouter.stats.remote())["ledger/running"])
            time.sleep(0.02)
        return elapsed, before, after
    finally:
        ray.get(rollouter.shutdown.remote())
        ray.kill(rollouter)
        ray.kill(queue)


def test_start_concurrent_gets_the_first_batch_out_sooner(ray_local, tmp_path):
    # 16 samples (the first step's 4 groups) decode at 4 per engine, 0.009 s a token, instead of all 256 admitted
    # samples at 64 per engine, 0.129 s a token: ~0.4 s against ~5 s. The assertion leaves a wide margin.
    paced, before, after = _first_batch(ray_local, tmp_path / "paced", start_concurrent=16)
    unpaced, _, _ = _first_batch(ray_local, tmp_path / "unpaced", start_concurrent=256)
    assert before * 4 <= 16, before  # the window held: at most 16 samples' worth of groups generating
    assert after > 4, after  # and it opened once the first batch was out
    assert paced < unpaced / 2, (paced, unpaced)


def test_a_failed_push_to_the_queue_fails_the_run_and_keeps_the_groups(ray_local, tmp_path):
    """An agent loop leaves an object Ray cannot serialise in its trajectories: the put of their groups fails, the
    groups go back on the re-issue list (not counted as accepted) and error() says what failed, so the trainer's
    next poll ends the run with it instead of waiting out get_timeout_s."""
    import time

    from fully_async.message_queue import create_message_queue
    from fully_async.rollouter import create_rollouter

    cfg = compose([*SMALL, "rollout.agent_loop=tests.fakes:UnpicklableAgentLoop"])
    at = cfg.async_training
    queue = create_message_queue(at.effective_queue_capacity(), at.max_staleness)
    rollouter = create_rollouter(cfg, str(resolve_model_path(cfg.model)), str(tmp_path), queue)
    try:
        ray_local.get(rollouter.start.remote(), timeout=120)
        deadline = time.monotonic() + 60
        while (error := ray_local.get(rollouter.error.remote())) is None:
            assert time.monotonic() < deadline, ray_local.get(rollouter.stats.remote())
            time.sleep(0.05)
        stats = ray_local.get(rollouter.stats.remote())
    finally:
        ray_local.get(rollouter.shutdown.remote(), timeout=60)
        ray_local.kill(rollouter)
        ray_local.kill(queue)
    assert "pushing" in error and "message queue failed" in error, error
    assert "TypeError: Could not serialize" in error and len(error) < 600, error[:2000]  # not the batch's repr
    assert stats["ledger/failed"] >= 1 and stats["ledger/reissued"] >= 1, stats
    assert stats["ledger/accepted"] == stats["groups_pushed"], stats  # nothing counted that the queue never got


def test_group_fn_rescores_whole_groups_before_they_are_queued(draining_run):
    """reward.group_fn in a real run: every trained reward is the group ranking's, the per-sample score is kept,
    the call's latency is in the reward metrics and each call is a span on the trace."""
    _, run_dir = draining_run
    trajs = trajectories(run_dir)
    assert len(trajs) == 8 * 4 * 4
    by_group: dict[str, list[float]] = {}
    for t in trajs:
        by_group.setdefault(t["prompt_uid"], []).append(t["reward"])
    for rewards in by_group.values():  # ranks 0..3 of the group's 4 samples, / 3
        assert sorted(rewards) == [0.0, 1 / 3, 2 / 3, 1.0], rewards
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["fully_async/reward/group_fn/calls"] for m in metrics) >= 8 * 4
    assert all(
        m["fully_async/reward/group_fn/errors"] == m["fully_async/reward/group_fn/timeouts"] == 0 for m in metrics
    )
    assert any(m["fully_async/reward/group_fn/latency_s"] > 0 for m in metrics)
    spans = [json.loads(line) for line in (run_dir / "trace" / "rollouter.jsonl").read_text().splitlines()]
    assert sum(s.get("name") == "group_fn" and s.get("lane") == "reward" for s in spans) >= 8 * 4


def test_dynamic_sampling_trains_only_varying_groups_within_the_bound_and_each_prompt_once(ray_local, tmp_path):
    """~Half the prompts always score 1.0: their groups are filtered (logged, counted, never trained, not re-issued),
    every step still trains groups_per_step groups whose rewards vary, and the staleness bound holds."""
    steps = 6
    cfg = compose(
        [*SMALL, f"trainer.total_steps={steps}", "reward.sources=[{kind: 'tests.fakes:half_constant_score'}]",
         "algorithm.filter_groups.enable=true", "async_training.max_staleness=1"]
    )  # fmt: skip
    run_schedule(cfg, tmp_path, str(resolve_model_path(cfg.model)))
    records = trajectories(tmp_path)
    trained = [r for r in records if not r.get("filtered")]
    filtered = [r for r in records if r.get("filtered")]
    assert len(trained) == steps * 4 * 4
    for step in range(1, steps + 1):
        groups: dict[str, list[float]] = {}
        for r in trained:
            if r["step"] == step:
                groups.setdefault(r["prompt_uid"], []).append(r["reward"])
        assert len(groups) == 4 and all(len(g) == 4 and len(set(g)) > 1 for g in groups.values()), (step, groups)
    assert max(r["trained_version"] - r["min_version"] for r in trained) <= 1
    trained_uids = {r["prompt_uid"] for r in trained}
    assert len(trained_uids) == steps * 4  # no prompt trained twice
    filtered_groups: dict[str, list[float]] = {}
    for r in filtered:
        filtered_groups.setdefault(r["prompt_uid"], []).append(r["reward"])
    assert filtered_groups and all(len(g) == 4 and len(set(g)) == 1 for g in filtered_groups.values())
    assert not trained_uids & set(filtered_groups)  # filtered prompts are not re-issued: trained-or-filtered once
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["fully_async/count/filtered_groups"] >= len(filtered_groups)
    # About half the prompts are constant, but a filtered group frees its admission slot at once, so between two
    # steps the rollouter looks at more prompts than it trains: the filtered share of all groups seen exceeds one
    # half by an amount that depends on timing (0.5-0.8 seen); it is never all of them.
    share = len(filtered_groups) / (len(filtered_groups) + len(trained_uids))
    assert 0.25 < share < 0.95, share
    assert any(m["fully_async/filtered_groups/ratio"] > 0 for m in metrics)


def test_overlong_shaping_lowers_the_reward_of_long_responses(ray_local, tmp_path):
    from fully_async.reward.shaping import overlong_penalty

    cfg = compose([*SMALL, "trainer.total_steps=1", "reward.overlong_buffer=32", "reward.overlong_penalty=0.5",
                   "engine.sim.length_median=230", "engine.sim.length_sigma=0.2"])  # fmt: skip
    run_schedule(cfg, tmp_path, str(resolve_model_path(cfg.model)))
    trajs = trajectories(tmp_path)
    assert any(t["response_length"] > 256 - 32 for t in trajs)  # some responses reached the buffer
    for t in trajs:
        score = float(t["response_length"] % 2 == 0)  # fully_async.reward.sim:score
        assert t["reward"] == pytest.approx(score + overlong_penalty(t["response_length"], 256, 32, 0.5)), t


def test_background_syncs_never_exceed_the_bound_over_random_timings(ray_local, tmp_path):
    """async_training.sync_mode=background with the real Rollouter, queue, ledger and ParamSync: over seeded random
    draws of the bound, the sync cadence, partial rollout and the speeds of decoding, training, export, pause and
    reload (from syncs that finish well inside a step to ones that take several), no sample is trained staler than
    the bound, no token is newer than the weights it is trained at (the engines serve a version only once it has
    reloaded), and every admitted prompt is trained once."""
    import random

    rng = random.Random(26)
    for draw in range(4):
        eta, every = rng.choice([0, 1, 2]), rng.choice([1, 2])
        overrides = [
            *SMALL,
            "async_training.sync_mode=background",
            f"async_training.max_staleness={eta}",
            f"async_training.sync_every={every}",
            f"async_training.partial_rollout={rng.choice(['true', 'false'])}",
            "trainer.total_steps=6",
            "engine.sim.time_scale=4",
            "trainer.sim.time_scale=4",
            f"engine.sim.decode_step_s={rng.uniform(0.001, 0.01):.4f}",
            f"engine.sim.pause_s={rng.uniform(0.0, 0.2):.3f}",
            f"engine.sim.reload_s={rng.choice([0.01, 0.2, 1.0, 3.0])}",
            f"trainer.sim.optimizer_step_s={rng.uniform(0.02, 0.4):.3f}",
            f"trainer.sim.export_gb_per_s={rng.choice([1.0, 10.0])}",
        ]
        cfg = compose(overrides)
        run_dir = tmp_path / f"draw{draw}"
        run_schedule(cfg, run_dir, str(resolve_model_path(cfg.model)))
        trajs = trajectories(run_dir)
        label = " ".join(overrides[len(SMALL) :])
        assert len(trajs) == 6 * 4 * 4, label
        assert max(t["trained_version"] - t["min_version"] for t in trajs) <= eta, label
        assert all(t["min_version"] <= t["max_version"] <= t["trained_version"] for t in trajs), label
        assert len({(t["prompt_uid"], t["sample_index"]) for t in trajs}) == len(trajs), label


def test_the_start_up_and_shutdown_are_timed_into_the_first_row_the_trace_and_startup_json(fully_async_run):
    _, run_dir = fully_async_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = {k.split("/", 2)[2]: v for k, v in rows[0].items() if k.startswith("timing_s/startup/")}
    assert {"placement", "data", "trainer_ranks", "wait_engines", "first_step", "total"} <= set(first)
    assert first["total"] >= first["first_step"] + first["trainer_ranks"] > 0
    assert not any(k.startswith("timing_s/startup/") for k in rows[1])  # the first step's row only
    spans = [s for s in load(run_dir)[0] if s.lane == "startup"]
    assert {s.name for s in spans} == set(first) - {"total"}
    record = json.loads((run_dir / "startup.json").read_text())
    assert record["startup"]["metrics"] == {f"timing_s/startup/{k}": v for k, v in first.items()}
    down = record["shutdown"]["parts"]
    assert {"rollouter", "trainer_ranks", "plots", "engine_hosts", "placement"} <= set(down)
    # The rollouter and the ranks stop at once: each begins before the other ended.
    assert down["rollouter"][0] < down["trainer_ranks"][1] and down["trainer_ranks"][0] < down["rollouter"][1]
    assert (run_dir / "reward_staleness.png").stat().st_size > 1000  # drawn during the shutdown, waited for
