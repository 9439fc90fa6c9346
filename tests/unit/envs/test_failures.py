"""The infrastructure-failure rule (fully_async/envs/failures.py) without servers: which errors are infrastructure,
which OpenEnv error replies are the model's, the retry loop's counts and its end, the env config's checks, the
missing-extra error. With real openenv-core servers: tests/integration/test_envs_openenv_errors.py."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from fully_async.config import ConfigError, EnvConfig
from fully_async.envs import require
from fully_async.envs.failures import (
    INFRA_KINDS,
    EnvProtocolError,
    InfraError,
    InfraExhausted,
    TaskError,
    classify,
    openenv_error,
    rejected,
    with_retries,
)


def test_infrastructure_failures_are_told_from_everything_else():
    assert classify(asyncio.TimeoutError()).kind == "timeout"
    assert classify(ConnectionRefusedError()).kind == "refused"
    assert classify(ConnectionResetError()).kind == "reset"
    assert classify(aiohttp.ServerDisconnectedError()).kind == "reset"
    info = aiohttp.RequestInfo(aiohttp.client.URL("http://127.0.0.1:1/ws"), "GET", {})  # type: ignore[arg-type]
    assert classify(aiohttp.WSServerHandshakeError(info, (), status=503)).kind == "http_5xx"
    assert classify(aiohttp.WSServerHandshakeError(info, (), status=404)) is None  # a wrong URL is no outage
    assert classify(ValueError("bad action")) is None
    assert classify(KeyError("bug")) is None


def test_retries_count_each_failure_and_end_in_exhausted():
    calls: list[int] = []
    suspects: list[str] = []

    async def attempt(k):
        calls.append(k)
        if k < 2:
            raise InfraError("closed", "server gone", url=f"http://s{k}")
        return "done"

    async def failed(err):
        suspects.append(err.url)

    counts: Counter[str] = Counter()
    assert asyncio.run(with_retries(attempt, 2, counts, failed)) == "done"
    assert calls == [0, 1, 2] and suspects == ["http://s0", "http://s1"]
    assert counts == {"env_infra_failures": 2, "env_infra/closed": 2, "env_retries": 2}

    counts = Counter()
    calls.clear()
    with pytest.raises(InfraExhausted, match="2 attempts failed"):
        asyncio.run(with_retries(attempt, 1, counts))
    assert calls == [0, 1] and counts["env_retries"] == 1 and counts["env_infra_failures"] == 2


def test_a_task_error_is_not_retried():
    calls: list[int] = []

    async def attempt(k):
        calls.append(k)
        raise ValueError("the environment rejected the action")

    with pytest.raises(ValueError):
        asyncio.run(with_retries(attempt, 3, Counter()))
    assert calls == [0]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("on_exhausted", "mask", "on_exhausted must be one of ['reissue', 'zero_reward']"),
        ("infra_retries", -1, "infra_retries must be >= 0"),
        ("urls", ["127.0.0.1:8000"], "urls[0] must be an http(s):// URL"),
        ("app", "digits", "app must be a dotted path"),
    ],
)
def test_env_config_errors_name_the_key_and_the_allowed_values(field, value, message):
    cfg = EnvConfig(**{field: value})
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        cfg.validate_section("rollout.multi_turn.env.")


def test_a_missing_package_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install -e \.\[envs\].*brings openenv-core"):
        require("fully_async_no_such_module", "openenv-core")


@pytest.mark.parametrize(
    ("code", "kind"),
    [("EXECUTION_ERROR", "execution"), ("CAPACITY_REACHED", "capacity"), ("FACTORY_ERROR", "factory"),
     ("SESSION_ERROR", "session"), ("SOMETHING_NEW", "unknown"), ("", "unknown")],
)  # fmt: skip
def test_an_openenv_error_reply_that_is_not_a_rejected_action_is_infrastructure_at_reset_and_step(code, kind):
    for call in ("reset", "step"):
        err = openenv_error(call, {"code": code, "message": "the database connection dropped"}, "http://e:1")
        assert isinstance(err, InfraError) and err.kind == kind and err.url == "http://e:1"
        assert kind in INFRA_KINDS


def test_only_a_step_the_environment_rejected_is_the_models():
    rejected_step = {"code": "VALIDATION_ERROR", "message": "Invalid message",
                     "errors": [{"type": "action_rejected", "loc": [], "msg": "no such column"}]}  # fmt: skip
    err = openenv_error("step", rejected_step)
    assert isinstance(err, TaskError) and str(err) == "no such column"
    assert isinstance(openenv_error("reset", rejected_step), EnvProtocolError)  # the model has not acted yet
    for code in ("INVALID_JSON", "UNKNOWN_TYPE"):  # our message, not the model's text
        assert isinstance(openenv_error("step", {"code": code, "message": "?"}), EnvProtocolError)


def test_an_action_field_the_environment_does_not_take_names_the_key():
    extra = {"code": "VALIDATION_ERROR", "errors": [{"type": "extra_forbidden", "loc": ["command"], "msg": "Extra"}]}
    with pytest.raises(EnvProtocolError, match=r"'command'.*rollout\.multi_turn\.env\.action_key"):
        raise openenv_error("step", extra, action_key="command")
    missing = {"code": "VALIDATION_ERROR", "errors": [{"type": "missing", "loc": ["query"], "msg": "Field required"}]}
    assert isinstance(openenv_error("step", missing), EnvProtocolError)
    other_field = {"code": "VALIDATION_ERROR", "errors": [{"type": "extra_forbidden", "loc": ["x"], "msg": "Extra"}]}
    assert isinstance(openenv_error("step", other_field, action_key="message"), TaskError)


def test_rejected_is_a_validation_error_of_its_own_type_that_json_can_carry():
    import json

    from pydantic import ValidationError

    err = rejected("no such {column}", "SELECT")
    assert isinstance(err, ValidationError)
    (detail,) = err.errors()
    assert detail["type"] == "action_rejected" and detail["msg"] == "no such {column}" and detail["input"] == "SELECT"
    json.dumps(err.errors())  # openenv-core sends the details as JSON: an exception object in them breaks the reply
