"""GatewayAgentLoop: an unmodified agent program trained through the gateway
(`rollout.agent_loop=fully_async.gateway.loop:GatewayAgentLoop`, the agent under `rollout.multi_turn.gateway`).

One episode: a session on this process's gateway (server.py) around a fresh ChatClient (the rollout-function loop's
exact-token bookkeeping, fully_async/agents/rollout_fn.py: appended turns as inserted tokens, an edited history
closes a row and starts a new one); the agent runs once (agent.py) with OPENAI_BASE_URL / OPENAI_API_KEY naming the
session and the prompt's fields (messages, data_source, extra_info; never the ground truth) in FULLY_ASYNC_TASK and
on stdin; its answer (agent.read_answer) is what the reward sources score. Everything else is the rollout-function
loop's: rows, limits (`max_turns`, the response budget: answered to the agent as OpenAI errors), partial rollout
(with it off, a weight change mid-episode restarts the agent), reward info (`turns`, `tool_calls`, `split_rows`).

Faults: an agent that crashes, hangs past `timeout_s` of its own time or is killed is an infrastructure failure: the
episode restarts from its prompt on a fresh session, up to `infra_retries` times, then InfraExhausted re-issues the
group (production.py), counted as `env_infra/agent_crash|agent_timeout` and `env_retries` in reward info (hence the
`env/infra/*` batch metrics). An agent that ends well without calling the model is its own error: the episode is the
prompt alone, scored on its answer, counted `agent_no_calls`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fully_async.agents.rollout_fn import ChatClient, RolloutFnAgentLoop
from fully_async.config import ConfigError, MultiTurnConfig
from fully_async.engines.auth import TOKEN_ENV
from fully_async.envs.failures import InfraError, InfraExhausted, with_retries
from fully_async.gateway.agent import CallableAgent, CommandAgent, crash, read_answer, supervise
from fully_async.gateway.server import NO_ANSWER, GatewayServer, Session, is_loopback

if TYPE_CHECKING:
    from fully_async.agents.base import Sample
    from fully_async.engines import EngineClient, Sampling
    from fully_async.protocol import Trajectory

log = logging.getLogger(__name__)

_SERVERS: dict[tuple, GatewayServer] = {}
"""One gateway per event loop and address in this process: the training and validation loops share it."""


async def shared_gateway(tokenizer: Any, host: str, port: int, model: str) -> GatewayServer:
    key = (id(asyncio.get_running_loop()), host, port, model)
    server = _SERVERS.get(key)
    if server is None:
        if not is_loopback(host) and not os.environ.get(TOKEN_ENV):
            raise ConfigError(f"rollout.multi_turn.gateway.host={host!r} leaves loopback: the run needs its token "
                              f"({TOKEN_ENV}, fully_async/engines/auth.py)")  # fmt: skip
        server = _SERVERS[key] = GatewayServer(tokenizer, host, port, model)
        try:
            await server.start()
        except BaseException:
            _SERVERS.pop(key, None)
            raise
        log.info("gateway at %s", server.url)
    return server


class GatewayAgentLoop(RolloutFnAgentLoop):
    """Runs the configured agent program per sample (module docstring); `run` returns the sample's rows."""

    def __init__(
        self,
        tokenizer: Any,
        sampling: Sampling,
        response_length: int,
        continue_on_abort: bool = True,
        multi_turn: MultiTurnConfig | None = None,
    ):
        multi_turn = multi_turn or MultiTurnConfig()
        self.gateway = multi_turn.gateway
        self.gateway.check_agent("rollout.multi_turn.gateway.")
        super().__init__(tokenizer, sampling, response_length, continue_on_abort, multi_turn, self._episode)
        self._function = None
        if self.gateway.function:
            from fully_async.plugins import load

            self._function = load(self.gateway.function, "rollout.multi_turn.gateway.function")
        else:
            program = shlex.split(self.gateway.command)[0]
            if os.sep in program and self.gateway.cwd:
                program = os.path.join(self.gateway.cwd, program)  # (an absolute path stays as it is)
            if shutil.which(program) is None:
                raise ConfigError(f"rollout.multi_turn.gateway.command={self.gateway.command!r}: {program!r} is no "
                                  "executable here (give a path, or a name on PATH)")  # fmt: skip
        self.counts: Counter[str] = Counter()
        """Per process: env_infra failures by kind, exhausted episodes, agents that never called the model."""

    async def server(self) -> GatewayServer:
        g = self.gateway
        return await shared_gateway(self.tokenizer, g.host, g.port, g.served_model_name)

    async def run(self, client: EngineClient, sample: Sample) -> Trajectory | list[Trajectory]:
        counts: Counter[str] = Counter()

        async def attempt(k: int) -> Trajectory | list[Trajectory]:
            return await RolloutFnAgentLoop.run(self, client, sample)

        try:
            out = await with_retries(attempt, self.gateway.infra_retries, counts)
        except InfraExhausted as e:
            self.counts.update(counts)
            self.counts["env_exhausted"] += 1
            if self.counts["env_exhausted"] == 1:
                log.warning("episode %s#%d: %s (further ones are counted)", sample.prompt.uid, sample.sample_index, e)
            raise
        self.counts.update(counts)
        last = out[-1] if isinstance(out, list) else out
        last.reward_info.update({"env_infra_failures": 0, "env_retries": 0, **counts})
        return out

    async def _episode(self, chat: ChatClient, tokenizer: Any, *, messages, data_source, extra_info, **_) -> Any:
        """The rollout function of one attempt: a session, the agent run once, its answer."""
        server = await self.server()
        session = server.open(chat)
        scratch = Path(tempfile.mkdtemp(prefix="fa-agent-"))
        task = {"messages": messages, "data_source": data_source, "extra_info": extra_info}
        t0 = time.monotonic()
        try:
            agent = self._agent(session, task, scratch / "answer.json")
            try:
                ended = await supervise(agent, session, self.gateway.timeout_s)
            except InfraError:
                if session.over is None:
                    raise
                ended = None  # past a limit the episode is over, however the agent ends
            if ended is not None and ended.code != 0 and session.over is None:
                raise crash(ended)
            answer = read_answer(session, scratch / "answer.json", ended, NO_ANSWER)
        finally:
            server.close(session)
            shutil.rmtree(scratch, ignore_errors=True)
        self._account(chat, session, time.monotonic() - t0)
        return answer

    def _agent(self, session: Session, task: dict[str, Any], answer_file: Path) -> CommandAgent | CallableAgent:
        if self._function is not None:
            return CallableAgent(self._function, session.base_url, session.key, task)
        g = self.gateway
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # the run's engine token stays ours
        env.update({str(k): str(v) for k, v in g.env.items()})  # a YAML or command-line number is a string here
        no_proxy = ",".join(x for x in (env.get("NO_PROXY", ""), "127.0.0.1,localhost") if x)
        # A row read from parquet may hold numpy values in extra_info: JSON gets their lists (or their text).
        payload = json.dumps(task, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
        env.update(OPENAI_BASE_URL=session.base_url, OPENAI_API_KEY=session.key, NO_PROXY=no_proxy,
                   no_proxy=no_proxy, FULLY_ASYNC_REWARD_URL=session.reward_url, FULLY_ASYNC_TASK=payload,
                   FULLY_ASYNC_ANSWER_FILE=str(answer_file), FULLY_ASYNC_MODEL=g.served_model_name)  # fmt: skip
        return CommandAgent(shlex.split(g.command), env, g.cwd, payload.encode() + b"\n")

    def _account(self, chat: ChatClient, session: Session, seconds: float) -> None:
        """What the episode's last row tells about the gateway (reward info; the rest is the rollout-function
        loop's)."""
        if session.over is not None:
            chat.finish_reason = "length"
        chat.info["gateway_calls"] = session.calls
        chat.info["agent_s"] = seconds
        chat.info.update({f"gateway_ignored/{k}": n for k, n in session.ignored.items()})
        if chat.turns == 0:
            chat.info["agent_no_calls"] = True
            self.counts["agent_no_calls"] += 1
            if self.counts["agent_no_calls"] == 1:
                log.warning("an agent ended without calling the model (its error; further ones are counted)")
