"""VerifiersAgentLoop: an installed verifiers (v1) environment, by name, as our prompts, agent loop and reward
(`rollout.agent_loop=fully_async.envs.verifiers_env:VerifiersAgentLoop`,
`reward.sources=[{kind: fully_async.envs.reward:env_reward}]`).

- Prompts: its taskset. `python -m fully_async.envs.verifiers_env NAME --out rows.jsonl` writes one dataset row per
  task (the task's system prompt and prompt as messages; `extra_info` names the environment and the task's index),
  used as `data.train_files`.
- Agent loop: its multi-turn protocol. The environment's own `Env.run(task, agents)` drives the episode; the agent
  it talks to is ours: `interaction(task).turn(message)` appends `message` as a user turn (tokens inserted after the
  template's turn boundary, loss mask 0, no version) and runs one model turn on our engines from the exact token
  list, as OpenEnvAgentLoop does. One trainable agent per episode (the environment's first); the turn cap is
  `rollout.multi_turn.max_turns`, after which `turn` answers a terminated segment.
- Reward: its rubric. The episode becomes a verifiers Trace (the messages, the sampled ones marked) and the task's
  `score(trace)` runs its `@vf.reward` functions and judges; the weighted sum reaches the trainer through the
  RewardAgent as the environment's reward (reward.py).

Failures (failures.py): an exception the environment raises for infrastructure reasons (verifiers' SandboxError,
InterceptionError, or a refused / reset connection, timeout or 5xx of a server it calls) restarts the episode on a
fresh environment instance, up to `env.infra_retries` times, then the group is re-issued; an error of our engines
passes through untouched (production's own failure path). Partial rollout and the staleness ledger as OpenEnv's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fully_async.agents.base import AgentLoop, Sample
from fully_async.agents.tokens import ChatDelta, Transcript
from fully_async.config import MultiTurnConfig
from fully_async.data import PromptRow
from fully_async.envs import require
from fully_async.envs.failures import InfraError, InfraExhausted, classify, with_retries
from fully_async.envs.reward import ENV_REWARD
from fully_async.protocol import Trajectory

if TYPE_CHECKING:
    from fully_async.engines import EngineClient, Sampling

log = logging.getLogger(__name__)

VF_ENV, VF_IDX = "vf_env", "vf_idx"
"""extra_info keys of an exported row: the environment's name and the task's index in its taskset."""
MAX_RESTARTS = 100
"""Episode restarts (partial rollout off) before the sample fails: a guard against an endless loop, not a knob."""

_ENVS: dict[str, tuple[Any, list[Any]]] = {}
"""Loaded environments by name, with their tasks: loaded once per process."""


def vf() -> Any:
    return require("verifiers.v1", "verifiers")


def load(name: str) -> tuple[Any, list[Any]]:
    """The installed verifiers environment `name` (its package, as `vf-eval NAME` finds it) and its tasks."""
    if name not in _ENVS:
        v = vf()
        env = v.load_environment(v.resolve_env_config({"taskset": {"id": name}}))
        _ENVS[name] = (env, list(env.taskset))
    return _ENVS[name]


def _messages(data: Any) -> list[dict[str, str]]:
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        out += [{"role": m.role, "content": _text(m.content)} for m in data.prompt or []]
    return out


def _text(content: Any) -> str:
    return content if isinstance(content, str) else vf().types.content_text(content)


def export_rows(name: str, limit: int | None = None) -> list[dict[str, Any]]:
    """One dataset row per task of environment `name` (data.train_files' jsonl shape)."""
    _, tasks = load(name)
    return [
        {"data_source": f"verifiers/{name}", "prompt": _messages(t.data),
         "reward_model": {"ground_truth": str(getattr(t.data, "answer", "") or "")},
         "extra_info": {VF_ENV: name, VF_IDX: i}}
        for i, t in enumerate(tasks[:limit])
    ]  # fmt: skip


def write_rows(name: str, out: str, limit: int | None = None) -> int:
    """Write `export_rows` to the jsonl file `out`; the number of rows."""
    rows = export_rows(name, limit)
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)


class _EngineFailure(Exception):
    """Carries an engine error through the environment's code, so it is never taken for the environment's."""


class _Restart(Exception):
    """The weights changed mid-episode with partial rollout off: the episode starts again."""


class _Interaction:
    """What the environment's `run` holds for our agent: `turn(message)` runs one model turn; `trace` is the
    episode as verifiers records it."""

    def __init__(self, loop: VerifiersAgentLoop, client: EngineClient, task: Any) -> None:
        self.loop, self.client, self.task = loop, client, task
        v = vf()
        self.trace = v.Trace(task=v.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                             agent=v.AgentInfo(config=v.AgentConfig(), name="solver"))  # fmt: skip
        self.tr: Transcript | None = None
        self.turns, self.start_version, self.num_aborts, self.finish = 0, None, 0, "stop"
        self.generate_s = 0.0

    def _node(self, message: Any, sampled: bool) -> None:
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(vf().MessageNode(message=message, sampled=sampled, parent=parent))

    async def turn(self, message: str | None = None) -> Any:
        v, loop = vf(), self.loop
        if self.turns >= loop.multi_turn.max_turns or self.finish == "length":
            return v.Segment(messages=[], terminated=True)
        if self.tr is None:
            messages = _messages(self.task.data) + ([{"role": "user", "content": message}] if message else [])
            for m in messages:
                self._node(v.SystemMessage(content=m["content"]) if m["role"] == "system"
                           else v.UserMessage(content=m["content"]), sampled=False)  # fmt: skip
            self.tr = Transcript(loop.chat.render_ids(messages, add_generation_prompt=True))
        elif message is not None:
            inserted = loop.chat.boundary(self.tr.last_token) + loop.chat.delta([{"role": "user", "content": message}])
            if len(self.tr) + len(inserted) >= loop.response_length:
                self.finish = "length"
                return v.Segment(messages=[], terminated=True)
            self.tr.add_inserted(inserted)
            self._node(v.UserMessage(content=message), sampled=False)
        left = loop.response_length - len(self.tr)
        cap = loop.multi_turn.max_tokens_per_turn
        t0 = time.monotonic()
        try:
            out = await self.client.generate(self.tr.ids, min(left, cap) if cap else left, loop.sampling,
                                             continue_on_abort=loop.continue_on_abort)  # fmt: skip
        except Exception as e:
            raise _EngineFailure() from e
        self.generate_s += time.monotonic() - t0
        self.start_version = out.start_version if self.start_version is None else self.start_version
        if not loop.continue_on_abort and any(ver != self.start_version for ver in out.versions):
            raise _Restart
        self.num_aborts += out.num_aborts
        self.tr.add_model(out.token_ids, out.logprobs, out.versions, out.cache_versions)
        self.turns += 1
        if out.finish_reason == "length" and len(self.tr) >= loop.response_length:
            self.finish = "length"
        reply = v.AssistantMessage(content=loop.decode(list(out.token_ids)))
        self._node(reply, sampled=True)
        return v.Segment(messages=[reply])


class _Agent:
    """The one trainable agent the environment's `run` talks to (verifiers' Agent surface: `interaction`)."""

    def __init__(self, loop: VerifiersAgentLoop, client: EngineClient) -> None:
        self.loop, self.client = loop, client
        self.trainable = True
        self.opened: _Interaction | None = None

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any) -> AsyncIterator[_Interaction]:
        if self.opened is not None:
            raise ValueError("this verifiers environment opens more than one interaction; one per episode is supported")
        self.opened = _Interaction(self.loop, self.client, task)
        yield self.opened


class _Agents:
    """verifiers' Agents surface (`agents.<role>`): every role is our one agent; a second role is refused."""

    def __init__(self, agent: _Agent) -> None:
        self._agent, self._role = agent, None

    def __getattr__(self, role: str) -> _Agent:
        if role.startswith("_"):
            raise AttributeError(role)
        if self._role not in (None, role):
            raise ValueError(f"verifiers environment uses roles {self._role!r} and {role!r}; one agent is supported")
        self._role = role
        return self._agent


def _infra(exc: BaseException) -> InfraError | None:
    """The infrastructure failure `exc` (raised by the environment's own code) stands for, or None."""
    v = vf()
    if isinstance(exc, v.SandboxError | v.InterceptionError):
        return InfraError("reset", f"{type(exc).__name__}: {exc}")
    return classify(exc)


class VerifiersAgentLoop(AgentLoop):
    def __init__(
        self,
        tokenizer: Any,
        sampling: Sampling,
        response_length: int,
        continue_on_abort: bool = True,
        multi_turn: MultiTurnConfig | None = None,
    ):
        super().__init__(tokenizer, sampling, response_length, continue_on_abort, multi_turn or MultiTurnConfig())
        self.chat = ChatDelta(tokenizer)
        self.counts: Counter[str] = Counter()
        """Over every episode of this loop: infrastructure failures by kind, retries, exhausted episodes."""

    def reward_meta(self, traj: Trajectory, row: PromptRow) -> dict[str, Any]:
        meta = super().reward_meta(traj, row)
        meta["extra_info"] = {**(meta.get("extra_info") or {}), ENV_REWARD: traj.reward_info.get(ENV_REWARD, 0.0)}
        return meta

    async def run(self, client: EngineClient, sample: Sample) -> Trajectory:
        extra = sample.row.extra_info
        if VF_ENV not in extra or VF_IDX not in extra:
            raise ValueError(f"row {sample.row.origin} names no verifiers task: export the environment's rows "
                             f"(python -m fully_async.envs.verifiers_env NAME --out rows.jsonl)")  # fmt: skip
        env, tasks = load(extra[VF_ENV])
        task = tasks[int(extra[VF_IDX])]
        counts: Counter[str] = Counter()

        async def attempt(k: int) -> Trajectory:
            for restarts in range(MAX_RESTARTS + 1):
                try:
                    traj = await self._episode(env, task, client, sample)
                except _Restart:
                    continue
                traj.reward_info["restarts"] = restarts
                return traj
            raise RuntimeError(f"sample {sample.prompt.uid}#{sample.sample_index} restarted {MAX_RESTARTS} times")

        try:
            traj = await with_retries(attempt, self.multi_turn.env.infra_retries, counts)
        except _EngineFailure as e:  # an engine's error is never the environment's: production handles it
            raise e.__cause__ from None
        except InfraExhausted as e:
            self.counts.update(counts)
            self.counts["env_exhausted"] += 1
            if self.counts["env_exhausted"] == 1:
                log.warning("episode %s#%d: %s (further ones are counted)", sample.prompt.uid, sample.sample_index, e)
            raise  # the group is re-issued (on_exhausted=zero_reward is OpenEnv's comparison rule only)
        self.counts.update(counts)
        traj.reward_info.update({"env_infra_failures": 0, "env_retries": 0, **counts})
        return traj

    async def _episode(self, env: Any, task: Any, client: EngineClient, sample: Sample) -> Trajectory:
        agent = _Agent(self, client)
        t0 = time.monotonic()
        try:
            await env.setup(_Agents(agent))
            await env.run(task, _Agents(agent))
            if agent.opened is None or agent.opened.tr is None:
                raise ValueError(f"verifiers environment {type(env).__name__} ran no model turn")
            chat = agent.opened
            await task.score(chat.trace)
        except (_EngineFailure, _Restart):
            raise
        except Exception as e:
            err = _infra(e)
            if err is None:
                raise
            raise err from e
        info: dict[str, Any] = {"turns": chat.turns, "env_turns": max(0, chat.turns - 1), ENV_REWARD: chat.trace.reward}
        info.update({f"vf/{k}": r.value for k, r in chat.trace.rewards.items() if r is not None})
        timings = {"generate_s": chat.generate_s, "env_s": time.monotonic() - t0 - chat.generate_s}
        return chat.tr.to_trajectory(prompt=sample.prompt, sample_index=sample.sample_index,
                                     start_version=chat.start_version, finish_reason=chat.finish,
                                     num_aborts=chat.num_aborts, reward_info=info, timings=timings)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="Write an installed verifiers environment's tasks as dataset rows.")
    parser.add_argument("name", help="the environment's name (its installed package, e.g. fa-vf-digits)")
    parser.add_argument("--out", required=True, help="the jsonl file to write (data.train_files)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many tasks")
    args = parser.parse_args()
    n = write_rows(args.name, args.out, args.limit)
    print(f"{n} rows of verifiers environment {args.name} -> {args.out}")


if __name__ == "__main__":
    main()
