"""ToolAgentLoop: multi-turn, hermes-style tool use, token-exact (`rollout.agent_loop=fully_async.agents.tool:ToolAgentLoop`).

One episode: the prompt (the row's messages rendered with the tools' schemas), then up to `max_turns` model turns
(each at most `max_tokens_per_turn` tokens when set; a turn cut there is closed by an inserted end-of-turn token).
After each turn the model's text is searched for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
none ends the episode (the model answered) unless `environment_turn` answers it (verl's "interaction": an
environment, not a tool, replies, e.g. "higher"; override it). Otherwise the first `max_parallel_calls` calls run concurrently, each
under `tool_timeout_s`, and their responses (each cut to `max_tool_response_tokens`) become tool messages whose tokens
are appended as inserted tokens (loss mask 0, NO_VERSION), with the template's turn boundary and the next assistant
header; then the model continues from the exact token list (fully_async/agents/tokens.py).

Contracts:
- The response (model + inserted tokens) never exceeds `response_length`: a tool block that would leave no room for
  one more model token is not appended and the episode ends (finish_reason 'length', reward info `budget_stop`).
- The model's mistakes and the tools' failures never end the run: a malformed call, an unknown tool, bad arguments,
  an exception and a timeout become a tool message saying so; each is counted in the trajectory's reward info
  (`tool_errors`, `tool_errors/<kind>`, and the flag `tool_error`).
- A weight sync during a tool call does not touch the tool: the next model call goes through EngineClient.generate,
  which waits for the resume and continues, so one trajectory may carry several versions, each token labelled by the
  weights that produced it. With partial rollout off (`continue_on_abort=False`) an episode whose tokens would span
  two versions restarts from its prompt (tools run again; reward info `restarts`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from fully_async.agents.base import AgentLoop, Sample
from fully_async.agents.tokens import ChatDelta, Transcript
from fully_async.agents.tool_images import check_vision_model, expand_turn, tool_content
from fully_async.agents.toolkit import (
    ERROR_KINDS,
    Tool,
    ToolCall,
    ToolResult,
    load_tools,
    parse_tool_calls,
    run_call,
)
from fully_async.config import MultiTurnConfig
from fully_async.protocol import Trajectory
from fully_async.reward.limiter import build_limiter

if TYPE_CHECKING:
    from fully_async.engines import EngineClient, Sampling

log = logging.getLogger(__name__)

TRUNCATED = "...(truncated)"
"""Appended to a tool response cut at max_tool_response_tokens."""
MAX_RESTARTS = 100
"""Episode restarts (partial rollout off) before the sample fails: a guard against an endless loop, not a knob."""


class _Restart(Exception):
    """The weights changed mid-episode with partial rollout off."""


class ToolAgentLoop(AgentLoop):
    def __init__(
        self,
        tokenizer: Any,
        sampling: Sampling,
        response_length: int,
        continue_on_abort: bool = True,
        multi_turn: MultiTurnConfig | None = None,
        tools: dict[str, Tool] | None = None,
    ):
        """`tools` overrides the configured ones (tests and programmatic use)."""
        super().__init__(tokenizer, sampling, response_length, continue_on_abort, multi_turn or MultiTurnConfig())
        cfg = self.multi_turn
        self.tools = tools if tools is not None else load_tools(cfg.tools, cfg.tool_config_path)
        self.limiters = {
            name: lim
            for name in self.tools
            if (lim := build_limiter(name, cfg.tool_limits, cfg.limiter_namespace, "tool")) is not None
        }
        """Per tool, the reward sources' limiter kind (rollout.multi_turn.tool_limits); none when nothing is limited."""
        self.chat = ChatDelta(tokenizer)
        self.counts: Counter[str] = Counter()
        """Over every episode of this loop: tool calls and errors by kind (logged once per tool and kind)."""

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def prompt_ids(self, sample: Sample) -> list[int]:
        """The engine's view of the prompt: one image token per image of the row."""
        kwargs = {"tools": self.tool_schemas} if self.tools else {}
        messages = list(sample.row.messages)
        if sample.row.images:
            messages = [{**m, "content": self.vision.prompt_text(m["content"])} for m in messages]
        return self.chat.render_ids(messages, add_generation_prompt=True, **kwargs)

    @functools.cached_property
    def serves_vision(self) -> bool:
        """Whether the model is a vision-language model: its turns then stop before a sampled vision token."""
        from fully_async.multimodal.processor import is_vision_model

        return is_vision_model(getattr(self.tokenizer, "name_or_path", "") or ".")

    def _transcript(self, sample: Sample) -> Transcript:
        ids, images = self.prompt_ids(sample), sample.row.images
        return Transcript(ids, images, self.vision.expand(ids, images) if images else None)

    async def run(self, client: EngineClient, sample: Sample) -> Trajectory:
        for restarts in range(MAX_RESTARTS + 1):
            try:
                traj = await self._episode(client, sample)
            except _Restart:
                continue
            traj.reward_info["restarts"] = restarts
            return traj
        raise RuntimeError(f"sample {sample.prompt.uid}#{sample.sample_index} restarted {MAX_RESTARTS} times")

    async def _episode(self, client: EngineClient, sample: Sample) -> Trajectory:
        cfg = self.multi_turn
        episode = f"{sample.prompt.uid}#{sample.sample_index}"
        tr = self._transcript(sample)
        info = _episode_info()
        timings = {"generate_s": 0.0, "tool_s": 0.0, "env_s": 0.0}
        start_version, num_aborts, finish = None, 0, "stop"
        created = await self._create(episode)
        try:
            for turn in range(cfg.max_turns):
                out = await self._model_turn(client, tr, timings)
                if start_version is None:
                    start_version = out.start_version
                if not self.continue_on_abort and any(v != start_version for v in out.versions):
                    raise _Restart  # this turn's tokens come from newer weights than the episode's first turn
                num_aborts += out.num_aborts
                tr.add_model(out.token_ids, out.logprobs, out.versions, out.cache_versions)
                info["turns"] += 1
                if out.finish_reason == "length" and len(tr) >= self.response_length:
                    finish = "length"
                    break
                text = self.tokenizer.decode(list(out.token_ids), skip_special_tokens=False)
                calls = self.tool_calls(turn, text)
                last = turn == cfg.max_turns - 1
                if calls and last:
                    info["max_turns_reached"] = True
                    break
                images: list[bytes] = []
                if calls:
                    t0 = time.monotonic()
                    messages, images = await self._run_tools(calls, episode, info)
                    timings["tool_s"] += time.monotonic() - t0
                else:
                    messages = None if last else await self._environment(sample, turn, text, episode, timings)
                    if not messages:
                        finish = out.finish_reason  # 'length' when the turn was cut at max_tokens_per_turn
                        break
                    info["env_turns"] += 1
                inserted = self.chat.boundary(tr.last_token) + self.chat.delta(messages)
                expanded = expand_turn(self.vision, inserted, images) if images or self.serves_vision else inserted
                if len(tr) + len(expanded) >= self.response_length:  # no room left for a model token after it
                    info["budget_stop"] = True
                    finish = "length"
                    break
                tr.add_inserted(inserted, images, expanded)
        finally:
            await self._release(episode, created)
        info["tool_error"] = info["tool_errors"] > 0
        return tr.to_trajectory(
            prompt=sample.prompt,
            sample_index=sample.sample_index,
            start_version=start_version,
            finish_reason=finish,
            num_aborts=num_aborts,
            reward_info=info,
            timings=timings,
        )

    async def _model_turn(self, client: EngineClient, tr: Transcript, timings: dict[str, float]) -> Any:
        """One generation of the model, within what is left of the response (and of a turn's token budget)."""
        left = self.response_length - len(tr)
        per_turn = self.multi_turn.max_tokens_per_turn
        budget = min(left, per_turn) if per_turn else left
        sampling, kwargs = self.sampling, {}
        if self.serves_vision:  # a sampled vision token would be an image token with no image (docs/vlm.md)
            sampling = dataclasses.replace(
                sampling, stop_token_ids=(*sampling.stop_token_ids, *self.vision.vision_token_ids)
            )
        if tr.images:
            kwargs["images"] = list(tr.images)
        t0 = time.monotonic()
        out = await client.generate(tr.ids, budget, sampling, continue_on_abort=self.continue_on_abort, **kwargs)
        timings["generate_s"] += time.monotonic() - t0
        if self.serves_vision:
            cut = self.vision.cut_response(out.token_ids, out.logprobs, out.versions, out.finish_reason)
            cache = None if out.cache_versions is None else out.cache_versions[: len(cut[0])]
            out = dataclasses.replace(out, token_ids=cut[0], logprobs=cut[1], versions=cut[2], finish_reason=cut[3],
                                      cache_versions=cache)  # fmt: skip
        return out

    async def _run_tools(
        self, calls: list[ToolCall], episode: str, info: dict[str, Any]
    ) -> tuple[list[dict[str, str]], list[bytes]]:
        """Run the first max_parallel_calls calls concurrently: their tool messages, in call order, and the images
        they return, in the order of their image tokens (agents/tool_images.py)."""
        cfg = self.multi_turn
        run = calls[: cfg.max_parallel_calls]
        info["tool_calls_skipped"] += len(calls) - len(run)
        results = await asyncio.gather(*(self._call(c, episode, info) for c in run))
        messages, images = [], []
        for call, res in zip(run, results):
            info["tool_calls"] += 1
            self.counts["tool_calls"] += 1
            if res.error is not None:
                self._count_error(call.name, res.error, res.text, info)
            text = self._cut(res.text, info)
            if res.images:
                check_vision_model(self.serves_vision, call.name, self.tokenizer)
                text = tool_content(self.vision, text, len(res.images))
                images.extend(res.images)
            messages.append({"role": "tool", "content": text})
        return messages, images

    async def _call(self, call: ToolCall, episode: str, info: dict[str, Any]) -> ToolResult:
        """One call under its tool's limiter (the wait is outside the timeout), recorded on the trace."""
        limiter = self.limiters.get(call.name) if call.error is None else None
        permit = None
        if limiter is not None:
            permit = await limiter.acquire()
            info["tool_limiter_wait_s"] = info.get("tool_limiter_wait_s", 0.0) + permit.wait_s
        start = time.time()
        try:
            res = await run_call(self.tools, call, episode, self.multi_turn.tool_timeout_s)
        finally:
            if permit is not None:
                limiter.release(permit)
        if self.tracer is not None:
            self.tracer.record(
                "tools", "tool_call", start, time.time(), tool=call.name, episode=episode, error=res.error
            )
        return res

    async def _environment(
        self, sample: Sample, turn: int, text: str, episode: str, timings: dict[str, float]
    ) -> list[dict[str, str]] | None:
        start, t0 = time.time(), time.monotonic()
        messages = await self.environment_turn(sample, turn, text)
        timings["env_s"] += time.monotonic() - t0
        if self.tracer is not None and messages:
            self.tracer.record("tools", "env_turn", start, time.time(), episode=episode)
        return messages

    async def environment_turn(self, sample: Sample, turn: int, text: str) -> list[dict[str, str]] | None:
        """The environment's answer to model turn `turn` (decoded `text`) that made no tool call, as chat messages
        (e.g. [{"role": "user", "content": "higher"}]); None or [] ends the episode. Inserted like tool turns (mask
        0, no version, the template's own rendering). Not asked after the last allowed turn. Default: None."""
        return None

    def tool_calls(self, turn: int, text: str) -> list[ToolCall]:
        """The calls in model turn `turn` (0-based) whose decoded text is `text`: hermes-style parsing. Override for
        another call format."""
        return parse_tool_calls(text)

    def _cut(self, text: str, info: dict[str, Any]) -> str:
        ids = self.chat.encode(text)
        if len(ids) <= self.multi_turn.max_tool_response_tokens:
            return text
        info["tool_truncated"] += 1
        return self.tokenizer.decode(ids[: self.multi_turn.max_tool_response_tokens]) + TRUNCATED

    def _count_error(self, name: str, kind: str, text: str, info: dict[str, Any]) -> None:
        info["tool_errors"] += 1
        info[f"tool_errors/{kind}"] += 1
        key = f"tool_errors/{kind}/{name or '?'}"
        self.counts[key] += 1
        if self.counts[key] == 1:  # first of its kind only: a model that keeps erring must not flood the log
            log.warning("tool call error (%s, tool %r): %s (further ones are counted in reward info)", kind, name, text)

    async def _create(self, episode: str) -> list[Tool]:
        created = []
        for tool in self.tools.values():
            if tool.create is not None:
                await tool.create(episode)
                created.append(tool)
        return created

    async def _release(self, episode: str, created: list[Tool]) -> None:
        for tool in created:
            if tool.release is not None:
                try:
                    await tool.release(episode)
                except Exception as e:  # a failed cleanup must not lose the episode
                    log.warning("releasing tool %s for %s failed: %s", tool.name, episode, e)


def _episode_info() -> dict[str, Any]:
    """An episode's counters in its reward info, each at zero."""
    info: dict[str, Any] = {"turns": 0, "env_turns": 0, "tool_calls": 0, "tool_errors": 0, "tool_calls_skipped": 0}
    info.update({f"tool_errors/{k}": 0 for k in ERROR_KINDS})
    info["tool_truncated"] = 0
    return info
