"""A third-party agent framework through the gateway: smolagents' ToolCallingAgent (the `agents` extra), unmodified,
drives a tool through OpenAI tool calls the gateway parsed from the model's hermes-style blocks, and its final answer
is what the reward sees; every model turn is recorded with the engine's exact tokens (mask 1) and everything the
framework added between them as inserted tokens (mask 0). Its `stop` and `tool_choice=required` are ignored and
counted (the run's sampling governs)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from fully_async.agents import Sample
from fully_async.config import MultiTurnConfig
from fully_async.config.sections.gateway import GatewayConfig
from fully_async.data import PromptRow
from fully_async.engines import Sampling
from fully_async.gateway import loop as gateway_loop
from fully_async.gateway.loop import GatewayAgentLoop
from fully_async.models.tiny import build_tokenizer
from fully_async.protocol import PromptRef
from tests import fakes
from tests.helpers import in_ci

if importlib.util.find_spec("smolagents") is None:
    message = "smolagents (the agents extra) is missing: FULLY_ASYNC_EXTRAS=agents bash scripts/setup.sh"
    if in_ci():
        pytest.fail(message + " (CI must install it)", pytrace=False)
    pytest.skip(message, allow_module_level=True)

LOOKUPS: list[str] = []


def smolagents_agent(base_url, api_key, task):
    """A ToolCallingAgent with one tool, as a smolagents user writes it (run by the loop in a thread)."""
    from smolagents import OpenAIModel, ToolCallingAgent, tool

    @tool
    def lookup(key: str) -> str:
        """Look a key up in the record.

        Args:
            key: the key to look up.
        """
        LOOKUPS.append(key)
        return f"{key.upper()}=7"

    model = OpenAIModel(model_id="policy", api_base=base_url, api_key=api_key)
    agent = ToolCallingAgent(tools=[lookup], model=model, max_steps=3, verbosity_level=0)
    return agent.run(task["messages"][-1]["content"])


def test_smolagents_drives_a_tool_through_the_gateway_token_exactly(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    turns = ['<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>',
             '<tool_call>{"name": "final_answer", "arguments": {"answer": "seven"}}</tool_call>']  # fmt: skip
    client = fakes.ScriptedClient(tok, turns, end=tok.convert_tokens_to_ids("<|im_end|>"))
    gateway = GatewayConfig(function=f"{__name__}:smolagents_agent", timeout_s=60)
    loop = GatewayAgentLoop(tok, Sampling(), 4096, True, MultiTurnConfig(gateway=gateway))
    row = PromptRow("t", [{"role": "user", "content": "what is a?"}], "7")

    async def main():
        try:
            return await loop.run(client, Sample(PromptRef(0, 0), 0, row))
        finally:
            for server in list(gateway_loop._SERVERS.values()):
                await server.stop()
            gateway_loop._SERVERS.clear()

    LOOKUPS.clear()
    out = asyncio.run(main())
    rows = out if isinstance(out, list) else [out]
    last = rows[-1]
    assert LOOKUPS == ["a"] and loop.reward_text(last) == "seven"  # the framework ran our tool call, then answered
    assert last.reward_info["turns"] == 2 and last.reward_info["tool_calls"] == 2
    assert last.reward_info["gateway_ignored/stop"] == 2 and last.reward_info["gateway_ignored/tool_choice"] == 2
    # smolagents sends its history back rewritten (the model's call as text 'Calling tools: [...]', the tool's answer
    # as a user turn 'Observation: ...'): the recorded row ends and a new one starts at each call (a history edit).
    # Each model turn is still the engine's exact tokens (mask 1); nothing else is trained.
    assert len(rows) == 2 and last.reward_info["split_rows"] == 2
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model_turns = [tok.encode(t) + [im_end] for t in turns]
    trained = [[int(x) for x, m in zip(r.response_ids, r.loss_mask) if m] for r in rows]
    assert sum(trained, []) == sum(model_turns, [])
