"""The gateway inside a whole simulated run (engine=sim, trainer=sim, the real Rollouter, queue and Trainer on local
Ray): an unmodified openai-SDK program (tests/gateway_agent.py) runs once per episode from the Rollouter actor, its
two calls per episode reach the step metrics, and agents SIGKILLed mid-episode are infrastructure failures: their
groups are re-issued, nothing of them is trained, and each prompt is trained once."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from fully_async.config import compose
from fully_async.config.sections.gateway import GATEWAY_LOOP
from fully_async.models import resolve_model_path
from fully_async.simulation import run_schedule

AGENT = Path(__file__).resolve().parents[1] / "gateway_agent.py"

RUN = [
    "engine=sim",
    "trainer=sim",
    f"rollout.agent_loop={GATEWAY_LOOP}",
    "rollout.n=2",
    "rollout.max_concurrent=4",
    "rollout.response_length=64",
    "rollout.multi_turn.max_tokens_per_turn=4",
    "engine.max_model_len=256",
    f"engine.sim.token_id={ord('q')}",  # no 'q' in the prompts or the agent's check
    "engine.sim.length_median=30",
    "engine.num_servers=1",
    "engine.sim.decode_step_s=0.001",
    "async_training.groups_per_step=2",
    "trainer.total_steps=2",
    "trainer.sim.optimizer_step_s=0.05",
]

pytestmark = pytest.mark.timeout(300)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_trains_an_openai_sdk_program_and_re_issues_the_groups_of_sigkilled_agents(ray_local, tmp_path):
    kills = tmp_path / "kills"
    kills.mkdir()
    cfg = compose([*RUN, f"rollout.multi_turn.gateway.command={sys.executable} {AGENT} sigkill_first",
                   "rollout.multi_turn.gateway.infra_retries=0",
                   f"+rollout.multi_turn.gateway.env.AGENT_KILLS={kills}",
                   "+rollout.multi_turn.gateway.env.AGENT_KILL_COUNT=2"])  # fmt: skip
    run_schedule(cfg, tmp_path / "run", str(resolve_model_path(cfg.model)))
    assert len(list(kills.iterdir())) == 2  # two agents were SIGKILLed after their first call
    trajs = records(tmp_path / "run" / "trajectories.jsonl")
    assert len(trajs) == 2 * 2 * 2
    per_prompt = Counter(t["prompt_uid"] for t in trajs)
    assert len(per_prompt) == 4 and set(per_prompt.values()) == {2}  # each prompt trained once, as a whole group
    # Every trained episode ran to its end: two model calls, no infrastructure failure in it.
    assert all(t["turns"] == 2 and t["env_infra_failures"] == 0 for t in trajs)
    steps = records(tmp_path / "run" / "metrics.jsonl")
    assert all(s["num_turns/mean"] == 2 for s in steps if "num_turns/mean" in s)
    assert max(s.get("fully_async/count/groups_env_infra", 0) for s in steps) == 2  # the killed ones: re-issued
