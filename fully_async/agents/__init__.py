"""Agent loops: how one sample is produced from a prompt (single_turn; tool: multi-turn tool use on an exact token
list, see tokens.py and docs/agents.md)."""

from fully_async.agents.base import AgentLoop, Sample, build_agent_loop

__all__ = ["AgentLoop", "Sample", "build_agent_loop"]
