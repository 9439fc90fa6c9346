"""ToolAgentLoop inside a whole simulated run (engine=sim, trainer=sim, the real Rollouter, queue and Trainer on local
Ray): the rollout.multi_turn section reaches the loop (its tools, its per-turn limit), tool turns end up in the
trained trajectories, the reward sees them and the step metrics count them. The call is forced (tests/fakes.py:ForcedToolAgentLoop)."""

from __future__ import annotations

import json

import pytest

from fully_async.config import compose
from fully_async.models import resolve_model_path
from fully_async.simulation import run_schedule
from fully_async.trace import load

TWO_STEPS = [
    "engine.num_servers=1",
    "engine.sim.decode_step_s=0.001",
    "async_training.groups_per_step=2",
    "trainer.total_steps=2",
    "trainer.sim.optimizer_step_s=0.05",
]
"""Two short simulated steps on one emulated server: the sizes every run of this module shares."""

pytestmark = pytest.mark.timeout(300)


def test_a_run_trains_on_multi_turn_tool_trajectories(ray_local, tmp_path):
    cfg = compose(
        [
            "engine=sim",
            "trainer=sim",
            "rollout.agent_loop=tests.fakes:ForcedToolAgentLoop",
            "rollout.multi_turn.tools=[tests.fakes:echo_tool]",
            "rollout.multi_turn.max_tokens_per_turn=8",
            "reward.sources=[{kind: 'tests.fakes:tool_seen_score'}]",
            "rollout.n=2",
            "rollout.response_length=96",
            "engine.max_model_len=256",
            "engine.sim.length_median=30",
            *TWO_STEPS,
        ]
    )
    run_schedule(cfg, tmp_path, str(resolve_model_path(cfg.model)))
    trajs = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 * 2 * 2
    assert all(t["reward"] == 1.0 for t in trajs)  # every trained response held the echo tool's turn
    # Two model turns of 8 tokens (the configured cap) around the inserted tool turn, within the budget.
    assert all(16 < t["response_length"] <= 96 for t in trajs)
    # The agent's reward info survived scoring: the step metrics count its turns and tool calls.
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(s["num_turns/mean"] == 2 and s["agent/tool_calls/mean"] == 1 for s in steps if "num_turns/mean" in s)
    assert sum("num_turns/mean" in s for s in steps) == 2
    # Each tool call is a span on the trace's tools lane.
    spans = [s for s in load(tmp_path)[0] if s.lane == "tools"]
    assert len(spans) >= 8 and {s.args["tool"] for s in spans} == {"echo_tool"}


def test_a_rollout_function_that_edits_history_trains_on_split_rows(ray_local, tmp_path):
    cfg = compose(
        [
            "engine=sim",
            "trainer=sim",
            "rollout.rollout_fn=tests.fakes:history_editing_rollout",
            "rollout.n=2",
            "rollout.response_length=64",
            "engine.max_model_len=256",
            *TWO_STEPS,
        ]
    )
    run_schedule(cfg, tmp_path, str(resolve_model_path(cfg.model)))
    trajs = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    # Every sample became two rows (before and after the edit) with the same reward: the function's answer scored.
    assert len(trajs) == 2 * 2 * 2 * 2
    by_sample: dict = {}
    for t in trajs:
        by_sample.setdefault((t["prompt_uid"], t["sample_index"]), []).append(t["reward"])
    assert len(by_sample) == 8 and all(len(r) == 2 and r[0] == r[1] for r in by_sample.values())
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["agent/split_rows"] for s in steps if "agent/split_rows" in s] == [4.0, 4.0]
    assert all(s["num_turns/mean"] == 3 for s in steps if "num_turns/mean" in s)


def test_tool_limits_hold_across_processes_through_one_named_actor(ray_local, tmp_path):
    """scope=cluster: every loop (every rollouter process) that limits a tool asks the same named Ray actor."""
    import asyncio
    import time

    from transformers import AutoTokenizer

    from fully_async.agents import Sample
    from fully_async.agents.tool import ToolAgentLoop
    from fully_async.agents.toolkit import function_tool
    from fully_async.config import MultiTurnConfig, RewardLimitsConfig
    from fully_async.data import PromptRow
    from fully_async.engines import Sampling
    from fully_async.models.tiny import build_tokenizer
    from fully_async.protocol import PromptRef
    from tests import fakes

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    cfg = MultiTurnConfig(tool_limits=RewardLimitsConfig(max_concurrent=1), limiter_namespace=f"t{time.time_ns()}")
    tools = {"hanging_tool": function_tool(fakes.hanging_tool)}
    loops = [ToolAgentLoop(tok, Sampling(), 200, multi_turn=cfg, tools=tools) for _ in range(2)]
    assert all(lp.limiters["hanging_tool"].actor is not None for lp in loops)
    call = '<tool_call>{"name": "hanging_tool", "arguments": {"seconds": 0.3}}</tool_call>'
    end = tok.convert_tokens_to_ids("<|im_end|>")

    async def go():
        clients = [fakes.ScriptedClient(tok, [call, "ok"], end=end) for _ in loops]
        sample = Sample(PromptRef(0, 0), 0, PromptRow("t", [{"role": "user", "content": "go"}], "1"))
        start = time.monotonic()
        trajs = await asyncio.gather(*(lp.run(c, sample) for lp, c in zip(loops, clients)))
        return trajs, time.monotonic() - start

    trajs, wall = asyncio.run(go())
    assert wall >= 0.6  # the two loops' calls ran one after the other
    assert max(t.reward_info.get("tool_limiter_wait_s", 0.0) for t in trajs) >= 0.25


def test_the_lookup_task_runs_its_tool_turns_through_the_pipeline(ray_local, tmp_path):
    """task=lookup (fully_async/agents/lookup.py) in a simulated run whose engine always answers the letter 'q': every
    first turn calls the lookup tool, its answer is inserted, the second 'q' is a call on the last turn (not run), so
    the rule scores 0; the step metric agent/tool_call_ratio counts the calls."""
    cfg = compose(
        [
            "task=lookup",
            "engine=sim",
            "trainer=sim",
            f"engine.sim.token_id={ord('q')}",
            "engine.sim.length_median=30",  # longer than a turn: every turn is cut at its one token, never a stop
            "rollout.n=2",
            *TWO_STEPS,
        ]
    )
    run_schedule(cfg, tmp_path, str(resolve_model_path(cfg.model)))
    trajs = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 * 2 * 2
    assert all(t["tool_calls"] == 1 and t["turns"] == 2 and t["reward"] == 0.0 for t in trajs), trajs[0]
    # 'q', the end of its turn, the tool turn holding '77777' (5 digits) and the next header, then 'q'
    assert all(t["response_length"] > 10 for t in trajs)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["agent/tool_call_ratio"] for s in steps if "agent/tool_call_ratio" in s] == [1.0, 1.0]
