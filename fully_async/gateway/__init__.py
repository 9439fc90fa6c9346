"""An OpenAI-compatible gateway: an agent program written against the `openai` SDK (or any framework that speaks
OpenAI's HTTP API) trains unmodified and token-exactly (docs/agents.md, "The gateway").

- server.py: the HTTP server (one per rollouter process, loopback by default) and its per-episode sessions;
- shapes.py: OpenAI's request and response shapes, what is refused and what is ignored;
- agent.py: the agent run once per episode (a command under the watchdog, or a Python callable), supervised;
- loop.py: GatewayAgentLoop (`rollout.agent_loop=fully_async.gateway.loop:GatewayAgentLoop`).

Contract: every model call of a session is one call of the episode's ChatClient (fully_async/agents/rollout_fn.py),
so the recorded tokens, log-probs and versions are the engine's, the rows and limits are the rollout-function loop's,
and a crashed, hung or killed agent is an infrastructure failure (fully_async/envs/failures.py), never a reward.
"""
