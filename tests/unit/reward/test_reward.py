"""RewardAgent with real worker processes: scores, hard timeouts that kill the worker, failures as flagged fallbacks."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from fully_async.config import RewardConfig, RewardSourceConfig
from fully_async.data import PromptRow, synthetic_rows
from fully_async.reward import RewardAgent

SYN = {"data_source": "fully_async/synthetic", "ground_truth": "7", "extra_info": {}}


@pytest.fixture
def agent_factory():
    made = []

    def make(**kw):
        a = RewardAgent(RewardConfig([RewardSourceConfig(**{"timeout_s": 5.0, **kw})], num_workers=2))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


async def test_synthetic_and_verl_default_scorers(agent_factory):
    agent = agent_factory()
    assert (await agent.score("7", SYN)).score == 1.0
    assert (await agent.score("8", SYN)).score == 0.0
    r = await agent.score("so #### 42", {"data_source": "openai/gsm8k", "ground_truth": "42", "extra_info": {}})
    assert r.score == 1.0 and not r.info.get("reward_failed")


async def test_a_hanging_function_is_killed_and_the_pool_keeps_working(agent_factory):
    agent = agent_factory(kind="tests.fakes:hanging_score", timeout_s=1.0, fallback_score=-1.0)
    await agent.score("warm", SYN)  # first call also pays the import; not what is timed below
    pids = {w.proc.pid for w in agent.pool._workers}
    start = time.monotonic()
    results = await asyncio.gather(*(agent.score("x", SYN) for _ in range(3)))
    # hanging_score never returns: only a kill at timeout_s ends these calls (30 s: a loaded box respawns workers slowly)
    assert time.monotonic() - start < 30
    for r in results:
        assert r.score == -1.0 and r.info["reward_failed"] and "timeout" in r.info["reward_error"]
    assert agent.pool.killed >= 4 and agent.timeouts >= 4
    for pid in pids:  # the hung workers are gone, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    agent.sources[0].source.cfg.kind = "fully_async.reward.rule:synthetic_score"
    assert (await agent.score("7", SYN)).score == 1.0  # replacements serve new calls


async def test_raising_and_malformed_functions_fall_back_with_a_flag(agent_factory):
    agent = agent_factory(kind="tests.fakes:raising_score")
    r = await agent.score("x", SYN)
    assert r.score == 0.0 and r.info["reward_failed"] and "verifier crashed on purpose" in r.info["reward_error"]
    agent.sources[0].source.cfg.kind = "tests.fakes:non_numeric_score"
    r = await agent.score("x", SYN)
    assert r.info["reward_failed"] and "finite number" in r.info["reward_error"]
    assert agent.failures == 2 and agent.pool.killed == 0  # a raise does not cost the worker


async def test_async_functions_run_on_the_loop_under_a_timeout(agent_factory):
    agent = agent_factory(kind="tests.fakes:slow_async_score", timeout_s=0.3)
    assert (await agent.score("7", SYN)).score == 1.0
    slow = await agent.score("7", {**SYN, "extra_info": {"sleep": 5}})
    assert slow.info["reward_failed"] and "timeout" in slow.info["reward_error"]


async def test_unknown_data_source_is_a_clear_error_naming_the_row(agent_factory):
    from fully_async.data import DataError

    agent = agent_factory()
    rows = synthetic_rows(3, 0) + [
        PromptRow("my/unknown_source", [{"role": "user", "content": "q"}], "1", {}, "d.jsonl:line 9")
    ]
    with pytest.raises(DataError, match=r"d.jsonl:line 9: unknown data_source 'my/unknown_source'"):
        await agent.check_sources(rows)
    await agent.check_sources(synthetic_rows(3, 0))  # known sources pass
    with pytest.raises(DataError, match="cannot be loaded"):
        await agent_factory(kind="no_such_module:fn").check_sources(rows)


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this process, except multiprocessing's resource tracker (one per
    interpreter, started with the first spawned process and kept for the interpreter's life)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            out.add(int(stat.parent.name))
    return out


@pytest.mark.parametrize("fn", ["tests.fakes:spinning_score", "tests.fakes:hanging_score"])
async def test_spinning_and_sleeping_sync_functions_are_cut_and_leave_nothing_behind(fn):
    children, threads = child_pids(), threading.active_count()
    agent = RewardAgent(RewardConfig([RewardSourceConfig(kind=fn, timeout_s=0.5)], num_workers=2))
    try:
        # Both workers import their modules first (a replacement's start-up is not what is timed below).
        warm = {"data_source": "x", "solution_str": "7", "ground_truth": "7", "extra_info": {}}
        await asyncio.gather(
            *(agent.pool.call("tests.fakes:raising_score", warm, 5.0) for _ in range(2)), return_exceptions=True
        )
        start = time.monotonic()
        results = await asyncio.gather(*(agent.score("x", SYN) for _ in range(2)))
        assert time.monotonic() - start < 5.0  # 0.5 s, plus killing and replacing two workers on a busy machine
        assert all("timeout after 0.5s" in r.info["reward_error"] for r in results)
        assert len(child_pids() - children) == 2  # the killed workers were replaced, not added to
    finally:
        await agent.aclose()
    deadline = time.monotonic() + 5
    while (child_pids() - children or threading.active_count() > threads) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert child_pids() - children == set(), "a reward worker outlived the agent"
    assert threading.active_count() <= threads, "a thread outlived the agent"
