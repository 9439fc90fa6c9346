"""OpenEnvAgentLoop: a multi-turn episode against an OpenEnv environment server, token-exact
(`rollout.agent_loop=fully_async.envs.openenv:OpenEnvAgentLoop`, `reward.sources=[{kind: fully_async.envs.reward:env_reward}]`).

One episode: a session on a server of the pool (OpenEnv's WebSocket protocol on /ws), `reset` with the row's
`ground_truth`, `episode_id` and its `extra_info['env_reset']` fields; the prompt is the row's messages plus the reset
observation as a user turn; then up to `rollout.multi_turn.max_turns` model turns, each sent to the environment as
`step({action_key: text})`; an observation that is not `done` is appended as a user turn, its tokens inserted
(loss mask 0, NO_VERSION) after the template's turn boundary (fully_async/agents/tokens.py), and the model continues
from the exact token list. The episode's reward is the last reward the environment returned; it reaches the trainer
through the RewardAgent (reward.py), so limits, timing metrics and group functions apply.

Failures (failures.py): an infrastructure failure (broken plumbing, or an error reply whose code says the
environment's own code failed: EXECUTION_ERROR, CAPACITY_REACHED, FACTORY_ERROR, SESSION_ERROR) restarts the episode
from its prompt on a fresh environment, up to `env.infra_retries` times, then the group is re-issued
(`on_exhausted=reissue`); only a step the environment's validation rejected (VALIDATION_ERROR, e.g. its
`raise failures.rejected(...)`) is the model's fault: the episode ends there with the reward so far
(`env_task_error` in reward info). Partial rollout and the staleness ledger work as for ToolAgentLoop: a sync
during an environment call only delays the next model call, which continues under the new weights; with partial
rollout off an episode whose tokens would span two versions restarts from its prompt (reward info `restarts`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from fully_async.agents.base import AgentLoop, Sample
from fully_async.agents.tokens import ChatDelta, Transcript
from fully_async.aio import bounded
from fully_async.config import EnvConfig, MultiTurnConfig
from fully_async.data import PromptRow
from fully_async.envs.failures import InfraError, InfraExhausted, TaskError, classify, openenv_error, with_retries
from fully_async.envs.pool import EnvServerPool
from fully_async.envs.reward import ENV_REWARD
from fully_async.protocol import Trajectory

if TYPE_CHECKING:
    from fully_async.engines import EngineClient, Sampling

log = logging.getLogger(__name__)

_POOLS: dict[str, EnvServerPool] = {}
"""One pool per environment config in this process: the training and validation loops share their servers."""
_POOLS_LOCK: asyncio.Lock | None = None


MAX_RESTARTS = 100
"""Episode restarts (partial rollout off) before the sample fails: a guard against an endless loop, not a knob."""


class _Restart(Exception):
    """The weights changed mid-episode with partial rollout off: the episode starts again on a new session."""


class OpenEnvSession:
    """One OpenEnv WebSocket session (one environment instance) on `url`. Calls raise InfraError for broken
    plumbing (failures.classify) and, for an error reply, what its code stands for (failures.openenv_error: TaskError
    only for a step the environment rejected); `action_key` is the action field steps carry the model's text in."""

    def __init__(self, url: str, timeout_s: float, action_key: str = "message") -> None:
        self.url, self.timeout_s, self.action_key = url, timeout_s, action_key
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    async def __aenter__(self) -> OpenEnvSession:
        self._http = aiohttp.ClientSession()
        try:
            self._ws = await bounded(self._http.ws_connect(self.url + "/ws"), self.timeout_s)
        except BaseException:
            await self._http.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self._ws is not None and not self._ws.closed:
                await bounded(self._ws.send_str(json.dumps({"type": "close", "data": {}})), 1.0)
                await self._ws.close()
        except Exception as e:  # closing a session on a dead server: nothing left to release
            log.debug("closing the environment session at %s failed: %s", self.url, e)
        finally:
            await self._http.close()

    async def call(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Send one message; the observation's data ({observation, reward, done})."""
        try:
            await self._ws.send_str(json.dumps({"type": kind, "data": data}))
            msg = await bounded(self._ws.receive(), self.timeout_s)
        except Exception as e:
            err = classify(e, self.url)
            if err is None:
                raise
            raise err from e
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
            raise InfraError("closed", f"the environment closed the session during {kind}", self.url)
        if msg.type == aiohttp.WSMsgType.ERROR:
            raise InfraError("reset", f"{self._ws.exception()}", self.url)
        reply = json.loads(msg.data)
        if reply.get("type") == "error":
            raise openenv_error(kind, reply.get("data") or {}, self.url, self.action_key)
        return reply.get("data") or {}


async def shared_pool(cfg: EnvConfig, log_dir: Path | None) -> EnvServerPool:
    """The process's started pool for `cfg` (started on first use)."""
    global _POOLS_LOCK
    if _POOLS_LOCK is None:
        _POOLS_LOCK = asyncio.Lock()
    key = json.dumps([cfg.app, cfg.urls, cfg.servers])
    async with _POOLS_LOCK:
        if key not in _POOLS:
            pool = EnvServerPool(cfg, log_dir)
            await pool.start()
            _POOLS[key] = pool
        return _POOLS[key]


class OpenEnvAgentLoop(AgentLoop):
    def __init__(
        self,
        tokenizer: Any,
        sampling: Sampling,
        response_length: int,
        continue_on_abort: bool = True,
        multi_turn: MultiTurnConfig | None = None,
        pool: EnvServerPool | None = None,
    ):
        """`pool` overrides the configured one (tests)."""
        super().__init__(tokenizer, sampling, response_length, continue_on_abort, multi_turn or MultiTurnConfig())
        self.env = self.multi_turn.env
        self.pool = pool
        self.chat = ChatDelta(tokenizer)
        self.counts: Counter[str] = Counter()
        """Over every episode of this loop: infrastructure failures by kind, retries, exhausted episodes."""
        self.latest_version = 0
        """Newest weight version a model turn of this loop ran under: a zeroed sample's version (zero_reward)."""

    async def _pool(self) -> EnvServerPool:
        if self.pool is None:
            log_dir = self.tracer.path.parent.parent / "envs" if self.tracer is not None else None
            self.pool = await shared_pool(self.env, log_dir)
        return self.pool

    def reward_meta(self, traj: Trajectory, row: PromptRow) -> dict[str, Any]:
        meta = super().reward_meta(traj, row)
        meta["extra_info"] = {**(meta.get("extra_info") or {}), ENV_REWARD: traj.reward_info.get(ENV_REWARD, 0.0)}
        return meta

    async def run(self, client: EngineClient, sample: Sample) -> Trajectory:
        pool = await self._pool()
        counts: Counter[str] = Counter()

        async def attempt(k: int) -> Trajectory:
            url = await pool.acquire()
            try:
                for restarts in range(MAX_RESTARTS + 1):
                    try:
                        traj = await self._episode(client, sample, url)
                    except _Restart:
                        continue
                    traj.reward_info["restarts"] = restarts
                    return traj
                raise RuntimeError(f"sample {sample.prompt.uid}#{sample.sample_index} restarted {MAX_RESTARTS} times")
            except InfraError as e:
                e.url = e.url or url
                raise
            finally:
                pool.release(url)

        async def failed(err: InfraError) -> None:
            if err.url:
                pool.suspect(err.url)

        try:
            traj = await with_retries(attempt, self.env.infra_retries, counts, failed)
        except InfraExhausted as e:
            self.counts.update(counts)
            self.counts["env_exhausted"] += 1
            if self.counts["env_exhausted"] == 1:
                log.warning("episode %s#%d: %s (further ones are counted)", sample.prompt.uid, sample.sample_index, e)
            if self.env.on_exhausted == "reissue":
                raise
            traj = self._zero_reward(sample)
        self.counts.update(counts)
        traj.reward_info.update({"env_infra_failures": 0, "env_retries": 0, **counts})
        return traj

    def _zero_reward(self, sample: Sample) -> Trajectory:
        """on_exhausted=zero_reward: the episode as if the model had said nothing and scored 0 (the naive rule), under
        the newest weights seen: version 0 would make its group look stale and be dropped, not trained."""
        tr = Transcript(self.chat.render_ids(list(sample.row.messages), add_generation_prompt=True))
        tr.add_inserted([self.chat.end_of_turn_id])
        return tr.to_trajectory(prompt=sample.prompt, sample_index=sample.sample_index, finish_reason="env_infra",
                                start_version=self.latest_version,
                                reward_info={ENV_REWARD: 0.0, "env_zeroed": True, "turns": 0})  # fmt: skip

    async def _episode(self, client: EngineClient, sample: Sample, url: str) -> Trajectory:
        env, row = self.env, sample.row
        info: dict[str, Any] = {"turns": 0, "env_turns": 0, ENV_REWARD: 0.0}
        timings = {"generate_s": 0.0, "env_s": 0.0}
        start_version, num_aborts, finish = None, 0, "stop"
        async with OpenEnvSession(url, env.call_timeout_s, env.action_key) as session:
            reset = {"episode_id": f"{sample.prompt.uid}#{sample.sample_index}", "ground_truth": row.ground_truth,
                     **(row.extra_info.get("env_reset") or {})}  # fmt: skip
            t0 = time.monotonic()
            obs = await session.call("reset", reset)
            timings["env_s"] += time.monotonic() - t0
            messages = list(row.messages)
            if text := self._text(obs):
                messages.append({"role": "user", "content": text})
            tr = Transcript(self.chat.render_ids(messages, add_generation_prompt=True))
            for turn in range(self.multi_turn.max_turns):
                left = self.response_length - len(tr)
                cap = self.multi_turn.max_tokens_per_turn
                t0 = time.monotonic()
                out = await client.generate(tr.ids, min(left, cap) if cap else left, self.sampling,
                                            continue_on_abort=self.continue_on_abort)  # fmt: skip
                timings["generate_s"] += time.monotonic() - t0
                start_version = out.start_version if start_version is None else start_version
                self.latest_version = int(max(self.latest_version, *out.versions, out.start_version))
                if not self.continue_on_abort and any(v != start_version for v in out.versions):
                    raise _Restart  # this turn's tokens come from newer weights than the episode's first turn
                num_aborts += out.num_aborts
                tr.add_model(out.token_ids, out.logprobs, out.versions, out.cache_versions)
                info["turns"] += 1
                t0 = time.monotonic()
                try:
                    obs = await session.call("step", {env.action_key: self.decode(list(out.token_ids))})
                except TaskError as e:
                    info["env_task_error"] = str(e)[:200]
                    break
                finally:
                    timings["env_s"] += time.monotonic() - t0
                if obs.get("reward") is not None:
                    info[ENV_REWARD] = float(obs["reward"])
                if obs.get("done") or turn == self.multi_turn.max_turns - 1:
                    break
                if out.finish_reason == "length" and len(tr) >= self.response_length:
                    finish = "length"
                    break
                inserted = self.chat.boundary(tr.last_token)
                inserted += self.chat.delta([{"role": "user", "content": self._text(obs)}])
                if len(tr) + len(inserted) >= self.response_length:
                    info["budget_stop"] = True
                    finish = "length"
                    break
                tr.add_inserted(inserted)
                info["env_turns"] += 1
        return tr.to_trajectory(prompt=sample.prompt, sample_index=sample.sample_index, start_version=start_version,
                                finish_reason=finish, num_aborts=num_aborts, reward_info=info,
                                timings=timings)  # fmt: skip

    def _text(self, data: dict[str, Any]) -> str:
        return str((data.get("observation") or {}).get(self.env.observation_key, ""))
