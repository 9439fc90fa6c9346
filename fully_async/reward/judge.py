"""LLM-as-judge through the official `openai` client against any OpenAI-compatible endpoint, and the retry policy
shared by every remote source.

Contracts:
- The API key comes from the environment variable *named* in `judge.api_key_env`; the key itself never appears in
  config, logs, reward info or error messages (errors are reduced to status code and a short body excerpt).
- One attempt = one chat completion under the source's limiter; its TPM reservation is settled with the usage the
  response reports (a failed attempt that the server refused uses nothing).
- Retried: timeouts, connection errors, 408, 429, 5xx and malformed 200 bodies, with exponential backoff and jitter,
  or exactly the server's Retry-After when it sends one. Never retried: other 4xx (a bad request stays bad) and a
  reply whose score cannot be parsed (flagged `parse_failed`, then the source's failure policy applies).
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import tenacity

from fully_async.config import ConfigError, JudgeConfig


class RemoteError(RuntimeError):
    """A remote call failed; `status` is the HTTP status (None: no response), `retry_after` the server's hint."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class ParseError(ValueError):
    """The judge answered, but its reply holds no score the parser accepts (not retried)."""


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError on 3.11+
        return True
    if isinstance(exc, RemoteError):
        return exc.status is None or exc.status in (408, 429) or exc.status >= 500
    return False


class WaitRetryAfter(tenacity.wait.wait_base):
    """Retry-After when the server sent one (plus up to 10% jitter so waiting clients do not return in lockstep),
    else exponential backoff with full jitter: uniform in [0, min(max_s, initial_s * 2^n)]."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s, self.max_s = initial_s, max_s

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        hint = getattr(exc, "retry_after", None)
        if hint is not None:
            return hint * (1.0 + 0.1 * random.random())
        ceiling = min(self.max_s, self.initial_s * 2 ** (retry_state.attempt_number - 1))
        return random.uniform(0.0, ceiling)


def parse_retry_after(headers: Any) -> float | None:
    """Seconds from Retry-After (seconds or an HTTP date) or retry-after-ms; None when absent or unreadable."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        when = email.utils.parsedate_to_datetime(value) if value else None
        return max(0.0, when.timestamp() - time.time()) if when else None


async def post_json(session: aiohttp.ClientSession, url: str, body: Any, who: str, headers: Any = None,
                    on_unreachable: Callable[[], Awaitable[None]] | None = None) -> Any:  # fmt: skip
    """POST `body` as JSON to `url`; the JSON answer. RemoteError naming `who` on an HTTP error (with its status and
    Retry-After, so `retryable` and WaitRetryAfter read them), an unreachable server (after `on_unreachable`), or an
    answer that is not JSON."""
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                raise RemoteError(f"{who} answered HTTP {resp.status}: {text}", resp.status,
                                  parse_retry_after(resp.headers))  # fmt: skip
            return await resp.json(content_type=None)
    except aiohttp.ClientError as e:
        if on_unreachable is not None:
            await on_unreachable()
        raise RemoteError(f"{who} unreachable at {url}: {type(e).__name__}") from None
    except ValueError as e:
        raise RemoteError(f"{who} sent a malformed response: {e}") from None


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def api_key(cfg: JudgeConfig, key: str) -> str | None:
    """The key from the environment variable the config names; a clear error naming the key when it is unset."""
    if not cfg.api_key_env:
        return None
    value = os.environ.get(cfg.api_key_env)
    if not value:
        raise ConfigError(f"{key}.api_key_env names the environment variable {cfg.api_key_env!r}, which is not set")
    return value


@dataclass
class Reply:
    score: float
    info: dict[str, Any]
    used_tokens: float | None


class Judge:
    """Renders the prompt, calls the endpoint once, parses the score. Retries and limits are the caller's."""

    def __init__(self, cfg: JudgeConfig, timeout_s: float, key: str) -> None:
        from openai import AsyncOpenAI

        self.cfg = cfg
        self._secret = api_key(cfg, key)
        # The client's own retries are off: ours honour Retry-After and go back through the limiter each attempt.
        self.client = AsyncOpenAI(
            base_url=cfg.base_url, api_key=self._secret or "unused", max_retries=0, timeout=timeout_s
        )
        self.pattern = re.compile(cfg.score_pattern)

    def render(self, solution: str, meta: dict[str, Any]) -> str:
        return self.cfg.prompt_template.format(
            question=meta.get("question", ""), response=solution, reference=_text(meta.get("ground_truth"))
        )

    def parse(self, text: str) -> float:
        matches = self.pattern.findall(text or "")
        if not matches:
            raise ParseError(f"no score in the judge's reply {(text or '')[:120]!r}")
        last = matches[-1]
        value = float(last[0] if isinstance(last, tuple) else last) / self.cfg.score_scale
        if value != value or value in (float("inf"), float("-inf")):
            raise ParseError(f"score {last!r} is not finite")
        return value

    async def ask(self, prompt: str) -> Reply:
        import openai

        try:
            resp = await self.client.chat.completions.create(
                model=self.cfg.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature,
            )
        except openai.APIStatusError as e:
            body = redact(str(getattr(e.response, "text", "") or "")[:200], self._secret)
            raise RemoteError(
                f"judge answered HTTP {e.status_code}: {body}", e.status_code, parse_retry_after(e.response.headers)
            ) from None
        except openai.APITimeoutError:
            raise TimeoutError("judge request timed out") from None
        except openai.APIConnectionError as e:
            raise RemoteError(f"judge unreachable: {type(e.__cause__ or e).__name__}") from None
        except (openai.APIResponseValidationError, json.JSONDecodeError, ValueError) as e:
            raise RemoteError(f"judge sent a malformed response: {type(e).__name__}", status=None) from None
        try:
            text = resp.choices[0].message.content
            usage = resp.usage.total_tokens if resp.usage is not None else None
        except (AttributeError, IndexError, TypeError) as e:
            raise RemoteError(f"judge sent a malformed response: {type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise RemoteError(f"judge sent a malformed response: message content is {type(text).__name__}")
        info: dict[str, Any] = {"usage_tokens": usage} if usage is not None else {"usage_missing": True}
        try:
            score = self.parse(text)
        except ParseError as e:
            e.used_tokens = usage  # the call itself succeeded: its tokens are settled all the same
            raise
        return Reply(score, info, usage)

    async def close(self) -> None:
        await self.client.close()


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)
