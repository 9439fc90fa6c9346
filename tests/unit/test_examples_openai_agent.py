"""examples/openai_agent: its agent program imports nothing of fully_async, makes two model calls per episode through
the gateway (with the example's own config: one-token turns, two turns) and its printed answer is what the copy
task's rule scores; the run's pieces (prompt row, reward) are the real ones, the engine a scripted one."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

from fully_async.agents import Sample
from fully_async.config import compose
from fully_async.data import synthetic_rows
from fully_async.engines import Sampling
from fully_async.gateway import loop as gateway_loop
from fully_async.gateway.loop import GatewayAgentLoop
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import PromptRef
from fully_async.reward.rule import synthetic_score
from tests import fakes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent"


def test_the_agent_imports_only_the_openai_sdk_and_the_standard_library():
    tree = ast.parse((EXAMPLE / "agent.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported == {"__future__", "json", "os", "sys", "openai"}


def test_an_episode_of_the_example_is_two_exact_calls_scored_on_the_printed_answer(tmp_path):
    from transformers import AutoTokenizer

    cfg = compose([f"rollout.multi_turn.gateway.command={sys.executable} {EXAMPLE / 'agent.py'}"],
                  config_dir=EXAMPLE, config_name="config")  # fmt: skip
    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    row = synthetic_rows(4, seed=0, task=cfg.data.synthetic_task)[0]
    digit = str(row.ground_truth)
    client = fakes.ScriptedClient(tok, ["3", digit], end=tok.convert_tokens_to_ids("<|im_end|>"))
    loop = GatewayAgentLoop(tok, Sampling(), cfg.rollout.response_length, True, cfg.rollout.multi_turn)

    async def main():
        try:
            return await loop.run(client, Sample(PromptRef(0, 0), 0, row))
        finally:
            for server in list(gateway_loop._SERVERS.values()):
                await server.stop()
            gateway_loop._SERVERS.clear()

    t = asyncio.run(main())
    assert t.reward_info["turns"] == 2 and t.reward_info["env_retries"] == 0 and client.budgets == [1, 1]
    assert t.loss_mask.sum() == 2  # two one-token model turns; the check between them is inserted
    assert loop.reward_text(t) == digit
    assert synthetic_score(row.data_source, loop.reward_text(t), row.ground_truth)["score"] == 1.0
