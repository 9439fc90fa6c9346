"""rLLM-style rollout functions (`rollout.rollout_fn=pkg.mod:fn`): the user writes the episode as chat calls, the
framework records the exact tokens underneath.

    async def fn(client, tokenizer, *, messages, data_source, ground_truth, extra_info, **_) -> str | None

`client.chat(messages, tools=None, max_tokens=None)` runs one model turn and returns an OpenAI-shaped assistant
message `{"role": "assistant", "content": str, "tool_calls": [{"id", "type": "function", "function": {"name",
"arguments": <JSON string>}}]}` (hermes-style `<tool_call>` blocks are parsed out of the content; a malformed block
stays in the content and is counted as `tool_errors/malformed`). The function runs the tools itself and calls `chat`
again with the conversation it wants the model to see. It returns the answer the configured reward sources score
(None: the content of the last assistant message).

Tokens (fully_async/agents/tokens.py). Each call's prompt is a token list, never a re-rendered chat when avoidable:
- the messages continue the conversation the client holds (its earlier messages, the assistant messages it
  returned, then new ones, with the same tools): the new messages are appended as inserted tokens (loss mask 0,
  rendered against a fixed prefix), so the model's own tokens stay exactly as sampled;
- otherwise the whole chat is rendered; when those ids extend the recorded sequence, the extra ids are inserted;
- otherwise (the user edited or dropped history) the recorded sequence is closed as one training row and a new row
  starts from the rendered prompt. The rows of a sample share its reward and its advantage (the last row is the
  sample's own; training/batch.py gives the others its advantage), reward info `split_rows` counts them and the
  step metric `agent/split_rows` counts the extra rows.

Limits: each row's response stays within `response_length`; at most `rollout.multi_turn.max_turns` chat calls per
episode (`max_tokens_per_turn` caps each). A call past either raises EpisodeOver; when the function lets it
propagate the episode ends there with finish_reason 'length' (what was generated is kept and scored). With partial
rollout off, an episode whose tokens would span two weight versions restarts the function from the start.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fully_async.agents.base import AgentLoop, Sample
from fully_async.agents.tokens import ChatDelta, Transcript
from fully_async.agents.toolkit import TOOL_CALL, parse_tool_calls
from fully_async.config import MultiTurnConfig
from fully_async.engines.affinity import keyed, session
from fully_async.protocol import Trajectory

if TYPE_CHECKING:
    from fully_async.engines import EngineClient, Sampling
    from fully_async.engines.base import GenerationResult

_EPISODES = itertools.count()
"""Numbers chat clients made outside a sample (no `sample_id`) a routing key of their own."""
MAX_RESTARTS = 100
"""Episode restarts (partial rollout off) before the sample fails: a guard against an endless loop, not a knob."""


class EpisodeOver(Exception):
    """The episode's response budget or turn limit is spent: no further chat call is possible."""


class _Restart(BaseException):
    """The weights changed mid-episode with partial rollout off. A BaseException so that a user's `except Exception`
    around a chat call does not swallow it."""


def _message_key(m: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two chat messages the same for the template: role, content, tool calls (arguments parsed)."""
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # not JSON: compared as the string it is
                args = json.loads(args) if args.strip() else {}
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return m.get("role"), m.get("content") or "", tuple(calls)


class ChatClient:
    """The `client` a rollout function gets: one episode of one sample (see the module docstring)."""

    def __init__(self, loop: RolloutFnAgentLoop, engine: EngineClient):
        self._loop, self._engine = loop, engine
        self.chat_delta = loop.chat
        self.rows: list[Transcript] = []
        """Closed rows (split off by a history edit), in order."""
        self.transcript: Transcript | None = None
        self._held: list[tuple[Any, ...]] | None = []  # message keys the current row's tokens stand for; None: unknown
        self._tools: list[dict[str, Any]] | None = None
        self.turns = 0
        self.start_version: int | None = None
        self.num_aborts = 0
        self.finish_reason = "stop"
        self.last_content = ""
        self.info: dict[str, Any] = {"tool_calls": 0, "tool_errors": 0, "tool_errors/malformed": 0}
        self.generate_s = 0.0
        self.last_output: GenerationResult | None = None
        """The last model turn's tokens, log-probs and versions (the gateway's usage and log-probs)."""
        self.session = session.get() or f"chat-{next(_EPISODES)}"
        """The episode's key for sticky routing (engines/affinity.py): its sample's, taken where the episode starts,
        so that calls arriving on other tasks (the gateway's HTTP handlers) carry it too."""

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None
    ) -> dict[str, Any]:
        """One model turn after `messages` (OpenAI chat messages; `tools`: OpenAI function schemas); the assistant
        message (see the module docstring). Raises EpisodeOver when the turn limit or the row's budget is spent."""
        self._check_turns()
        self._extend(list(messages), tools)
        out = await self._generate(max_tokens)
        tokenizer = self._loop.tokenizer
        raw = tokenizer.decode(list(out.token_ids), skip_special_tokens=False)
        message = self._assistant_message(raw, tokenizer.decode(list(out.token_ids), skip_special_tokens=True))
        self.last_content = message["content"]
        self._held.append(_message_key(message))
        return message

    async def complete(self, prompt_ids: list[int], max_tokens: int | None = None) -> GenerationResult:
        """One model turn after a raw token prompt (an OpenAI completion, fully_async/gateway/): ids that extend the
        row's sequence are appended as inserted tokens, others close the row and start a new one (a history edit).
        The next `chat` renders its whole chat (no messages are held). Raises EpisodeOver as `chat` does."""
        self._check_turns()
        self._extend_ids(list(prompt_ids))
        self._held, self._tools = None, None
        out = await self._generate(max_tokens)
        self.last_content = self._loop.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        return out

    def _check_turns(self) -> None:
        if self.turns >= self._loop.multi_turn.max_turns:
            raise EpisodeOver(f"rollout.multi_turn.max_turns={self._loop.multi_turn.max_turns} chat calls done")

    async def _generate(self, max_tokens: int | None) -> GenerationResult:
        """Generate into the current row within its budget; record the tokens, their log-probs and versions."""
        loop, tr = self._loop, self.transcript
        left = loop.response_length - len(tr)
        budget = min(left, max_tokens or left, loop.multi_turn.max_tokens_per_turn or left)
        if budget < 1:
            self.finish_reason = "length"
            raise EpisodeOver(f"the response budget of {loop.response_length} tokens is spent")
        t0 = time.monotonic()
        with keyed(self.session):
            out = await self._engine.generate(tr.ids, budget, loop.sampling, continue_on_abort=loop.continue_on_abort)
        self.generate_s += time.monotonic() - t0
        if self.start_version is None:
            self.start_version = out.start_version
        if not loop.continue_on_abort and any(v != self.start_version for v in out.versions):
            raise _Restart
        self.num_aborts += out.num_aborts
        tr.add_model(out.token_ids, out.logprobs, out.versions, out.cache_versions)
        self.turns += 1
        self.finish_reason = out.finish_reason
        self.last_output = out
        return out

    def _assistant_message(self, raw: str, text: str) -> dict[str, Any]:
        calls = parse_tool_calls(raw)
        good = [c for c in calls if c.error is None]
        self.info["tool_errors/malformed"] += len(calls) - len(good)
        self.info["tool_errors"] += len(calls) - len(good)
        self.info["tool_calls"] += len(good)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if good:
            message["content"] = TOOL_CALL.sub("", text).strip() if len(good) == len(calls) else text
            message["tool_calls"] = [
                {
                    "id": f"call_{self.turns - 1}_{j}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for j, c in enumerate(good)
            ]
        return message

    def _extend(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Make the current row's token list end with `messages`' generation prompt (the module docstring's three
        cases)."""
        chat = self.chat_delta
        kwargs = {"tools": tools} if tools else {}
        tr = self.transcript
        keys = [_message_key(m) for m in messages]
        held = self._held
        if tr is not None and held is not None and tools == self._tools and keys[: len(held)] == held:
            inserted = chat.boundary(tr.last_token) + chat.delta(messages[len(held) :])
            self._insert(inserted)
        else:
            self._extend_ids(chat.render_ids(messages, add_generation_prompt=True, **kwargs))
        self._tools = tools
        self._held = keys

    def _extend_ids(self, ids: list[int]) -> None:
        """Make the current row's token list end with `ids`: start it, append the extra ids as inserted tokens, or
        (the history was edited) close the recorded row and start a new one from `ids`."""
        tr = self.transcript
        if tr is not None and len(ids) >= len(tr.ids) and ids[: len(tr.ids)] == tr.ids:
            self._insert(ids[len(tr.ids) :])
            return
        if tr is not None and tr.mask and any(tr.mask):
            self.rows.append(tr)
        self.transcript = Transcript(ids)

    def _insert(self, ids: list[int]) -> None:
        tr = self.transcript
        if len(tr) + len(ids) >= self._loop.response_length:  # no room for a model token after it
            self.finish_reason = "length"
            self.info["budget_stop"] = True
            raise EpisodeOver(f"the new messages do not fit the response budget of {self._loop.response_length}")
        tr.add_inserted(ids)


RolloutFn = Callable[..., Awaitable[Any]]


class RolloutFnAgentLoop(AgentLoop):
    """Runs `rollout.rollout_fn` per sample (the rollouter picks this loop when that key is set); `run` returns the
    sample's rows: one Trajectory, or a list when history edits split it (AgentLoop's contract)."""

    def __init__(
        self,
        tokenizer: Any,
        sampling: Sampling,
        response_length: int,
        continue_on_abort: bool = True,
        multi_turn: MultiTurnConfig | None = None,
        rollout_fn: str | RolloutFn | None = None,
    ):
        super().__init__(tokenizer, sampling, response_length, continue_on_abort, multi_turn or MultiTurnConfig())
        if isinstance(rollout_fn, str):
            from fully_async.plugins import load

            rollout_fn = load(rollout_fn, "rollout.rollout_fn")
        if not inspect.iscoroutinefunction(rollout_fn):
            raise TypeError(f"rollout.rollout_fn must be an async function, got {rollout_fn!r}")
        self.fn = rollout_fn
        self.chat = ChatDelta(tokenizer)
        self._answers: weakref.WeakKeyDictionary[Trajectory, str] = weakref.WeakKeyDictionary()

    async def run(self, client: EngineClient, sample: Sample) -> Trajectory | list[Trajectory]:
        for restarts in range(MAX_RESTARTS + 1):
            chat = ChatClient(self, client)
            row = sample.row
            try:
                answer = await self.fn(
                    chat,
                    self.tokenizer,
                    messages=[dict(m) for m in row.messages],
                    data_source=row.data_source,
                    ground_truth=row.ground_truth,
                    extra_info=dict(row.extra_info),
                )
            except _Restart:
                continue
            except EpisodeOver:
                chat.finish_reason = "length"
                answer = None
            return self._rows(chat, sample, answer, restarts)
        raise RuntimeError(f"sample {sample.prompt.uid}#{sample.sample_index} restarted {MAX_RESTARTS} times")

    def _rows(self, chat: ChatClient, sample: Sample, answer: Any, restarts: int) -> Trajectory | list[Trajectory]:
        last = chat.transcript
        if last is None:  # the function never called the model: one row, the prompt alone
            last = Transcript(self.chat.render_ids(list(sample.row.messages), True))
        rows = [*chat.rows, last]  # a new row is only started by a chat call, which generates into it
        start = chat.start_version if chat.start_version is not None else 0
        out = []
        for k, tr in enumerate(rows):
            final = k == len(rows) - 1
            info: dict[str, Any] = {"split_rows": len(rows), "split_part": k}
            if final:
                info.update(chat.info, turns=chat.turns, restarts=restarts)
                info["tool_error"] = chat.info["tool_errors"] > 0
            out.append(
                tr.to_trajectory(
                    prompt=sample.prompt,
                    sample_index=sample.sample_index,
                    start_version=start,
                    finish_reason=chat.finish_reason if final else "stop",
                    num_aborts=chat.num_aborts if final else 0,
                    reward_info=info,
                    timings={"generate_s": chat.generate_s} if final else {},
                )
            )
        self._answers[out[-1]] = chat.last_content if answer is None else str(answer)
        return out if len(out) > 1 else out[0]

    def reward_text(self, traj: Trajectory) -> str:
        """The function's answer (or the last assistant content) for the sample whose last row is `traj`."""
        text = self._answers.get(traj)
        return text if text is not None else super().reward_text(traj)
