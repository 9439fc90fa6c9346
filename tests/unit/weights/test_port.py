"""The engine port (fully_async/weights/port.py): its two sides, EnginePort (what the transports and fully_async.ctl
ask with) and EngineService (what the Rollouter answers with, engines/service.py), name the same calls with the same
parameters; each port method is one `engine.remote` call of its own name, its arguments checked before it is sent."""

from __future__ import annotations

import inspect

import pytest

from fully_async.engines.service import EngineService
from fully_async.handles import LocalActor, resolve
from fully_async.weights.port import CALLS, EnginePort


def _parameters(function) -> list[tuple]:
    """(name, kind, default, annotation) of each parameter after `self`."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default, p.annotation) for p in params]


def test_both_sides_of_the_port_name_the_same_calls_with_the_same_parameters():
    answered = {n for n, m in vars(EngineService).items() if inspect.isfunction(m) and not n.startswith("_")}
    assert answered - {"call", "stats"} == CALLS, "a call on one side of the port only"
    assert {"load_weights", "nodes", "rpc", "rows"} <= CALLS
    for name in sorted(CALLS):
        assert _parameters(getattr(EnginePort, name)) == _parameters(getattr(EngineService, name)), name


class _Answers:
    """Stands in for the Rollouter actor: records each engine port call and answers with its name."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def engine(self, call: str, *args):
        self.sent.append((call, *args))
        return f"{call} answered"


def test_a_port_method_is_one_engine_call_of_its_name_sent_in_order_with_its_defaults():
    answers = _Answers()
    handle = LocalActor(answers)
    port = EnginePort(handle)
    try:
        reload = port.load_weights("/w/v3", 3)  # in flight: the caller decides when to wait
        assert resolve(port.nodes()) == "nodes answered"
        assert resolve(reload) == "load_weights answered"
        resolve(port.add(2))
        resolve(port.remove("http://127.0.0.1:8101", drain_timeout_s=5.0))
        with pytest.raises(TypeError):
            port.rpc(0, "fa_check")  # spec and timeout_s missing: refused here, nothing sent
        with pytest.raises(AttributeError):
            port.stop  # noqa: B018 - a call the port does not have
    finally:
        handle.close()
    assert answers.sent == [("load_weights", "/w/v3", 3, None), ("nodes",), ("add", 2, None),
                            ("remove", "http://127.0.0.1:8101", None, 5.0)]  # fmt: skip
