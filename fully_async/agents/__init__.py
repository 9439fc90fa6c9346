"""Agent loops: how one sample is produced from a prompt (single turn here; multi-turn tool use plugs in the same way)."""

from fully_async.agents.base import AgentLoop, Sample, build_agent_loop

__all__ = ["AgentLoop", "Sample", "build_agent_loop"]
