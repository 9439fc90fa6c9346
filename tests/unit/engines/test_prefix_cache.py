"""Prefix-cache counts read from generate answers (fully_async/engines/prefix_cache.py) and the step's hit rates made of
two readings (fully_async/metrics.py `prefix_cache_metrics`). The real vLLM answer is checked in
tests/integration/test_engine_servers.py."""

from __future__ import annotations

from fully_async.engines.prefix_cache import PrefixCacheCounts, reported
from fully_async.metrics import prefix_cache_metrics

VLLM = {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                 "prompt_tokens_details": {"cached_tokens": 32}}}  # fmt: skip
SGLANG = {"output_ids": [1], "meta_info": {"prompt_tokens": 20, "cached_tokens": 16, "finish_reason": None}}


def test_what_each_engine_reports_and_what_reports_nothing():
    assert reported(VLLM) == (40, 32)
    assert reported(SGLANG) == (20, 16)
    assert reported({"choices": [], "usage": {"prompt_tokens": 40}}) is None  # vLLM without the flag
    assert reported({"choices": [], "usage": {"prompt_tokens": 4, "prompt_tokens_details": None}}) is None
    assert reported({"choices": []}) is None and reported(None) is None and reported([VLLM]) is None


def test_counts_add_up_per_server_and_stay_empty_when_nothing_reports():
    counts = PrefixCacheCounts()
    counts.record(1, {"choices": []})
    assert counts.counts() == {}  # an engine that reports nothing: no counts, hence no metric
    counts.record(1, VLLM)
    counts.record(1, VLLM)
    counts.record(0, SGLANG)
    assert counts.counts() == {"prompt_tokens": [20, 80], "cached_tokens": [16, 64]}
    counts.record(3, VLLM)  # a server that joined the pool later
    assert counts.counts()["prompt_tokens"] == [20, 80, 0, 40]


def test_the_step_hit_rate_is_of_the_tokens_answered_during_the_step():
    last = {"prompt_tokens": [100, 50], "cached_tokens": [10, 40]}
    now = {"prompt_tokens": [300, 50, 100], "cached_tokens": [190, 40, 25]}
    m = prefix_cache_metrics(now, last)
    p = "fully_async/engines/prefix_cache_hit_rate"
    assert m == {p: 205 / 300, f"{p}/server_0": 180 / 200, f"{p}/server_2": 0.25}  # server 1 answered nothing
    assert prefix_cache_metrics({}, {}) == {} and prefix_cache_metrics(last, last) == {}
    assert prefix_cache_metrics(now, {}) == {p: 255 / 450, f"{p}/server_0": 190 / 300, f"{p}/server_1": 0.8,
                                             f"{p}/server_2": 0.25}  # fmt: skip


def test_the_trainer_logs_the_rates_of_the_rollouters_readings():
    from fully_async.trainer import step_window

    def stats(t: float, prefix_cache: dict) -> dict:
        return {"time": t, "engine_busy_s": [0.0, 0.0], "tokens": 0, "groups_failed": 0, "reward_timeouts": 0,
                "prefix_cache": prefix_cache}  # fmt: skip

    queue = {"size": 0, "dropped_stale": 0}
    m = step_window(stats(0.0, {}), stats(1.0, {"prompt_tokens": [10, 0], "cached_tokens": [9, 0]}), queue, 0.0, [])
    assert m["fully_async/engines/prefix_cache_hit_rate"] == 0.9 and "prefix_cache_hit_rate/server_1" not in str(m)
    assert not any("prefix_cache" in k for k in step_window(stats(0.0, {}), stats(1.0, {}), queue, 0.0, []))
