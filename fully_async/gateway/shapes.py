"""OpenAI's wire shapes: what a request asks (checked, with what the gateway ignores named) and the JSON bodies it
answers (completions, stream chunks, errors). Pure functions, no I/O.

What the gateway cannot honour token-exactly it refuses (`RequestError`, HTTP 400) or ignores and counts:
- refused: n > 1, images or audio in a message, a batch of prompts, `suffix`, `echo`;
- ignored, counted as `gateway_ignored/<key>`: sampling keys (the run's sampling governs every call, or the trainer's
  log-probs would not be the behaviour policy's), `stop` (cutting the text would leave tokens the engine sampled
  unrecorded), `tool_choice` other than "auto"/"none" (the engine cannot force a call), `response_format`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

IGNORED = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed", "logit_bias", "stop",
           "response_format", "min_p", "repetition_penalty", "parallel_tool_calls")  # fmt: skip
"""Request keys the gateway accepts and does not apply (counted per episode as gateway_ignored/<key>)."""


class RequestError(ValueError):
    """A request the gateway refuses; `param` names the offending key (OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    stream: bool = False
    usage_in_stream: bool = False
    logprobs: bool = False
    ignored: list[str] = field(default_factory=list)


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    max_tokens: int | None = None
    stream: bool = False
    logprobs: bool = False
    ignored: list[str] = field(default_factory=list)


def _common(body: Any) -> tuple[int | None, list[str]]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("n", 1) not in (1, None):
        raise RequestError(f"n must be 1 (one sample per call: the episode is one trajectory), got {body['n']!r}", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    return max_tokens, [k for k in IGNORED if body.get(k) is not None]


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined; other parts are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text")):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}: only text content is served, got a {kind!r} part", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string or a list of text parts", "messages")


def chat_request(body: Any) -> ChatRequest:
    """The chat-completion request in `body`, messages normalised (text content, tool-call arguments as given)."""
    max_tokens, ignored = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a non-empty list of message objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if "role" not in m:
            raise RequestError(f"messages[{i}] has no role", "messages")
        m = {k: v for k, v in m.items() if v is not None}
        m["content"] = _text(m.get("content"), f"messages[{i}]")
        out.append(m)
    tools = body.get("tools") or None
    choice = body.get("tool_choice")
    if choice == "none":
        tools = None
    elif choice not in (None, "auto"):
        ignored.append("tool_choice")
    stream_options = body.get("stream_options") or {}
    return ChatRequest(out, tools, max_tokens, bool(body.get("stream")), bool(stream_options.get("include_usage")),
                       bool(body.get("logprobs")), ignored)  # fmt: skip


def completion_request(body: Any) -> CompletionRequest:
    """The completion request in `body`: one prompt, text or token ids."""
    max_tokens, ignored = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise RequestError("prompt must be one non-empty string or one list of token ids (no batches)", "prompt")
    for key in ("suffix", "echo"):
        if body.get(key):
            raise RequestError(f"{key} is not served (the recorded tokens are the prompt's and the model's)", key)
    logprobs = body.get("logprobs")
    return CompletionRequest(prompt, max_tokens, bool(body.get("stream")), logprobs is not None and logprobs is not False,
                             ignored)  # fmt: skip


def error(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def finish(message: dict[str, Any], engine_finish: str) -> str:
    """OpenAI's finish_reason of a turn: tool_calls, length (cut at a token limit) or stop."""
    if message.get("tool_calls"):
        return "tool_calls"
    return "length" if engine_finish == "length" else "stop"


def token_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """A chat choice's `logprobs`: each sampled token and its behaviour log-prob (no alternatives)."""
    return {"content": [{"token": tokenizer.decode([t]), "logprob": float(lp), "bytes": None, "top_logprobs": []}
                        for t, lp in zip(ids, logprobs)]}  # fmt: skip


def chat_response(cid: str, model: str, message: dict[str, Any], reason: str, use: dict, lps: dict | None = None):
    wire = {"role": "assistant", "content": message.get("content") or None}
    if message.get("tool_calls"):
        wire["tool_calls"] = message["tool_calls"]
    elif wire["content"] is None:
        wire["content"] = ""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": wire, "finish_reason": reason, "logprobs": lps}],
            "usage": use}  # fmt: skip


def chat_chunks(cid: str, model: str, message: dict[str, Any], reason: str, use: dict | None) -> list[dict]:
    """The stream of one turn (generated whole, then sent): role, content, tool calls, the finish, usage if asked."""
    head = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        out.append(chunk({"content": message["content"]}))
    for j, call in enumerate(message.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": j, **call}]}))
    out.append(chunk({}, reason))
    if use is not None:
        out.append({**head, "choices": [], "usage": use})
    return out


def completion_response(cid: str, model: str, text: str, reason: str, use: dict, lps: dict | None = None):
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": lps}], "usage": use}  # fmt: skip


def completion_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs], "top_logprobs": None,
            "text_offset": offsets}  # fmt: skip


def models(name: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "fully_async"}]}


def sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
