"""The infrastructure-failure rule: an environment's broken plumbing never becomes a reward.

An environment call fails for one of two reasons. A *task error* is the model's fault (an action the environment
rejects, a wrong answer): the environment is alive and says so, and the episode's reward stands, low as it may be.
An *infrastructure failure* is nobody's answer: the connection was refused or reset, the call timed out, the server
answered 5xx, the server died, or the environment's own code raised (a sandbox, database or tool backend that fails
inside `step`). Scoring such an episode 0 would train a fake reward (open-instruct measured 5-15 % of episodes turned
into zeros by preemptions, biasing every group's baseline).

An OpenEnv server answers every failure with the same `{"type": "error"}` reply; `openenv_error` reads its code
(docs/environments.md has the table): only a step whose action the environment rejected through validation
(VALIDATION_ERROR, e.g. `raise rejected("...")`) is the model's; an exception inside the environment
(EXECUTION_ERROR) and a session it could not open (CAPACITY_REACHED, FACTORY_ERROR, SESSION_ERROR) are
infrastructure; a reply that says the loop and the environment disagree (the action field, the reset's fields, the
protocol) is neither, and fails the group loudly (EnvProtocolError).

So an episode hit by an infrastructure failure restarts from its prompt on a fresh environment (another server of
the pool, a new session), up to `rollout.multi_turn.env.infra_retries` times. Past the budget the episode raises
`InfraExhausted`; production drops the whole group and re-issues its prompt through admission, the same path as an
engine failure, so the staleness ledger stays exact (each prompt trained once) and no group is trained with a sample
missing from its baseline. `on_exhausted=zero_reward` keeps the naive rule (reward 0) for comparisons only.

Counted per sample in the reward info (`env_infra_failures`, `env_retries`, `env_infra/<kind>`), hence in
trajectories.jsonl and the batch metrics, and per run in the Rollouter's counters (`groups_env_infra`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

log = logging.getLogger(__name__)

T = TypeVar("T")

INFRA_CODES = {"EXECUTION_ERROR": "execution", "CAPACITY_REACHED": "capacity", "FACTORY_ERROR": "factory",
               "SESSION_ERROR": "session"}  # fmt: skip
"""OpenEnv error codes that are infrastructure, and their kind: an exception inside the environment's reset or step,
a server at its session limit, an environment that could not be built, a session that broke."""

INFRA_KINDS = ("refused", "reset", "timeout", "http_5xx", "closed", *INFRA_CODES.values(), "unknown")
"""Kinds of infrastructure failure, as counted in reward info (`env_infra/<kind>`) and per batch (`env/infra/<kind>`);
`unknown`: an error reply with a code this loop does not know (never taken for the model's)."""

REJECTED = "action_rejected"
"""The pydantic error type of `rejected()`."""

UNSERIALIZABLE = "Unable to serialize unknown type"
"""openenv-core 0.3.0 fails to send a VALIDATION_ERROR whose details hold an exception (a validator of the Action that
raised ValueError or AssertionError) and answers SESSION_ERROR with this pydantic message, then closes the session:
during a step, that is still an action the environment's validation rejected."""


class InfraError(Exception):
    """An environment call failed for infrastructure reasons; `kind` is one of INFRA_KINDS."""

    def __init__(self, kind: str, message: str, url: str = "") -> None:
        super().__init__(f"{kind}: {message}" + (f" ({url})" if url else ""))
        self.kind, self.url = kind, url


class InfraExhausted(InfraError):
    """Every attempt of one episode failed for infrastructure reasons: the group is re-issued, never scored."""


class TaskError(Exception):
    """A live environment rejected the model's action (its validation): the model's fault, the reward so far stands."""


class EnvProtocolError(RuntimeError):
    """The environment and this loop disagree (an action field it does not take, reset fields it rejects, a message it
    cannot parse): no one's reward and no transient failure. Not retried: the group is re-issued and, when every group
    fails so, the run stops with this message (`advanced.failed_groups_in_a_row`)."""


def rejected(reason: str, action: Any = None) -> Exception:
    """What an OpenEnv environment raises, in `step` or in a validator of its Action class, to say the model's action
    is at fault (`raise rejected("no such column", action.message)`): a pydantic ValidationError of type
    `action_rejected`, which openenv-core answers as VALIDATION_ERROR and the loop reads as the model's (the episode
    ends with the reward so far). Any other exception in `step` reads as the environment's own failure (retried on a
    fresh session, never a reward). Needs pydantic only, which every OpenEnv server has."""
    from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

    error = PydanticCustomError(REJECTED, str(reason))  # no context: the reason is never formatted as a template
    return ValidationError.from_exception_data("action", [InitErrorDetails(type=error, loc=(), input=action)])


def openenv_error(call: str, data: dict[str, Any], url: str = "", action_key: str = "message") -> Exception:
    """The exception an OpenEnv `{"type": "error"}` reply (its `data`) to a `call` ('reset' or 'step') stands for:
    TaskError (the model's: a step the environment's validation rejected), InfraError (an exception inside the
    environment, a session it could not open, a code not known here) or EnvProtocolError (the loop and the environment
    disagree). `action_key` is the action field the loop sends the model's text in."""
    code, message = str(data.get("code", "")), str(data.get("message", ""))
    errors = [e for e in data.get("errors") or [] if isinstance(e, dict)]
    detail = "; ".join(str(e.get("msg", "")) for e in errors) or message
    if code == "SESSION_ERROR" and message.startswith(UNSERIALIZABLE):
        detail = f"the action failed a validator of the environment (openenv-core could not send why: {message})"
    if code == "VALIDATION_ERROR" or (code == "SESSION_ERROR" and message.startswith(UNSERIALIZABLE)):
        if call != "step":
            return EnvProtocolError(f"the environment rejected the {call} at {url} (its fields come from the row: "
                                    f"ground_truth, extra_info.env_reset): {detail}")  # fmt: skip
        mismatch = [e for e in errors if e.get("type") == "missing" or
                    (e.get("type") == "extra_forbidden" and list(e.get("loc") or [])[:1] == [action_key])]  # fmt: skip
        if mismatch:
            return EnvProtocolError(f"the environment at {url} does not take its action as "
                                    f"{{{action_key!r}: text}} (rollout.multi_turn.env.action_key): {detail}")  # fmt: skip
        return TaskError(detail)
    if code in INFRA_CODES:
        return InfraError(INFRA_CODES[code], f"{code} during {call}: {message}", url)
    if code in ("INVALID_JSON", "UNKNOWN_TYPE"):
        return EnvProtocolError(f"the environment at {url} did not understand the {call} message ({code}): {message}")
    return InfraError("unknown", f"error reply {code or 'without a code'} during {call}: {message or data}", url)


def classify(exc: BaseException, url: str = "") -> InfraError | None:
    """The InfraError an exception from an environment call stands for, or None when it is no infrastructure
    failure (a bug or a task error, which the caller handles)."""
    if isinstance(exc, InfraError):
        return exc
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return InfraError("timeout", "the environment call timed out", url)
    if isinstance(exc, aiohttp.WSServerHandshakeError | aiohttp.ClientResponseError):
        if exc.status >= 500:
            return InfraError("http_5xx", f"HTTP {exc.status}", url)
        return None
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return InfraError("refused", str(exc), url)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | ConnectionError):
        return InfraError("reset", str(exc), url)
    if isinstance(exc, aiohttp.ClientError):
        return InfraError("reset", f"{type(exc).__name__}: {exc}", url)
    return None


async def with_retries(
    attempt: Callable[[int], Awaitable[T]],
    retries: int,
    counts: Counter[str],
    on_failure: Callable[[InfraError], Awaitable[None]] | None = None,
) -> T:
    """`await attempt(k)` for k = 0, 1, ... until one returns; an attempt that raises an infrastructure failure
    (see `classify`) is counted in `counts` (`env_infra_failures`, `env_infra/<kind>`, `env_retries`) and, after
    `on_failure(err)` (e.g. mark the server suspect), retried, at most `retries` times; then InfraExhausted. Any
    other exception propagates at once."""
    for k in range(retries + 1):
        try:
            return await attempt(k)
        except Exception as e:
            err = classify(e)
            if err is None:
                raise
            counts["env_infra_failures"] += 1
            counts[f"env_infra/{err.kind}"] += 1
            if on_failure is not None:
                await on_failure(err)
            if k == retries:
                raise InfraExhausted(err.kind, f"{retries + 1} attempts failed; last: {err}", err.url) from e
            counts["env_retries"] += 1
            log.info("environment attempt %d failed (%s); retrying on a fresh environment", k, err)
    raise AssertionError("unreachable")  # the loop returns or raises
