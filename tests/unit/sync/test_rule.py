"""The one rule of a sync, both modes (fully_async/sync/param_sync.py's table): who runs each part of a plan, and who
waits for it. A transport written here holds each part of its plan still with an event, so every "waits for" is
proven by what has (not) happened while a call is held, not by wall-clock bounds.

- `queue` runs in the caller's thread, inside `start`, in both modes;
- every other phase runs in PhaseRunner's thread, `param-sync-<phase>`;
- blocking: `start` returns only once every phase ran, the engines resumed; nothing is left for `weights_read` or
  `wait`;
- background: `start` returns before the reads end; `weights_read` (the trainer's next update) waits until they
  ended, and for nothing after them; pause, the engines' phases and resume run after `start` returned, and `wait`
  collects them.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from fully_async.handles import LocalActor
from fully_async.sync import ParamSync
from fully_async.weights.base import SyncPlan, WeightTransport
from tests.fakes import StubRollouter

HELD_S = 0.2
"""How long a held call is watched for returning too early."""


class GatedTransport(WeightTransport):
    """One phase in each part of a plan: `hand` (queue), `read` (reads), `write` (ahead), `load` (engines). Each
    notes its thread; `read` and `load` say they started, then wait for their gate (set: not held)."""

    name = "gated"

    def __init__(self, rollouter, backend, root, dtype, verify=True) -> None:
        self.root = Path(root)
        self.gates = {"read": threading.Event(), "load": threading.Event()}
        self.started = {"read": threading.Event(), "load": threading.Event()}
        self.ended = {"read": threading.Event(), "load": threading.Event()}
        self.thread: dict[str, str] = {}

    def _phase(self, name: str):
        def run() -> None:
            self.thread[name] = threading.current_thread().name
            if name in self.gates:
                self.started[name].set()
                assert self.gates[name].wait(10), f"{name} was held for good"
                self.ended[name].set()

        return name, run

    def plan(self, version: int, background: bool) -> SyncPlan:
        p = self._phase
        return SyncPlan(queue=(p("hand"),), reads=(p("read"),), ahead=(p("write"),), engines=(p("load"),))

    def export(self, version: int) -> Path:
        return self.root

    def close(self, remove: bool = True) -> None:
        pass


@pytest.fixture
def built(tmp_path, request):
    stub = StubRollouter()
    handle = LocalActor(stub)
    sync = ParamSync(handle, None, tmp_path, "float32", 10.0, transport=f"{__name__}:GatedTransport",
                     mode=request.param)  # fmt: skip
    yield stub, sync, sync.transport
    for gate in sync.transport.gates.values():
        gate.set()
    sync.close()
    handle.close()


def _in_thread(fn) -> tuple[threading.Event, dict]:
    """Call `fn` in a thread of its own; (set once it returned, {"out": its result})."""
    returned, out = threading.Event(), {}
    threading.Thread(target=lambda: (out.update(out=fn()), returned.set()), daemon=True).start()
    return returned, out


@pytest.mark.parametrize("built", ["blocking"], indirect=True)
def test_blocking_the_caller_is_held_through_every_phase_and_nothing_is_left_in_flight(built):
    stub, sync, transport = built
    for gate in transport.gates.values():
        gate.set()
    t = sync.start(1)
    # Every phase ran before start returned, the engines resumed.
    assert [c[0] for c in stub.calls] == ["pause", "resume"]
    assert {f"timing_s/param_sync/{p}" for p in ("hand", "read", "write", "pause", "load", "resume")} <= set(t)
    assert not sync.reading and sync.weights_read() == {} and sync.wait() == {}
    caller = threading.current_thread().name
    assert transport.thread == {"hand": caller, "read": "param-sync-read", "write": "param-sync-write",
                                         "load": "param-sync-load"}  # fmt: skip


@pytest.mark.parametrize("built", ["background"], indirect=True)
def test_background_the_next_update_waits_only_until_the_weights_were_read_and_the_rest_is_collected(built):
    stub, sync, transport = built
    t = sync.start(1)  # the reads are held: start must not wait for them
    assert not transport.ended["read"].is_set() and stub.calls == []
    assert set(t) == {"timing_s/param_sync/connect", "timing_s/param_sync/hand", "timing_s/param_sync"}
    assert sync.reading

    read, got = _in_thread(sync.weights_read)  # the trainer's next update
    assert not read.wait(HELD_S), "weights_read returned while the reads were held"
    transport.gates["read"].set()
    assert read.wait(10), "weights_read still waits once the reads ended (it waits for the held load?)"
    assert not transport.ended["load"].is_set()  # it did not wait for the engines' phases
    assert set(got["out"]) == {"timing_s/param_sync/read", "timing_s/param_sync"}

    collected, done = _in_thread(sync.wait)  # the next start, or a checkpoint
    assert transport.started["load"].wait(10) and not collected.wait(HELD_S), "wait returned while load was held"
    assert [c[0] for c in stub.calls] == ["pause"]  # paused after start returned, by ParamSync's thread
    transport.gates["load"].set()
    assert collected.wait(10)
    assert [c[0] for c in stub.calls] == ["pause", "resume"]
    assert {f"timing_s/param_sync/{p}" for p in ("write", "pause", "load", "resume", "background", "wait")} <= set(
        done["out"]
    )
    caller = threading.current_thread().name
    assert transport.thread == {"hand": caller, "read": "param-sync-read", "write": "param-sync-write",
                                         "load": "param-sync-load"}  # fmt: skip
