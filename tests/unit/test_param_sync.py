"""ParamSync's protocol without Ray: the simulated training backend, a stub rollouter at the edge (tests/fakes.py)
run in process through LocalActor. Phase order, per-phase timings and trace spans, a phase that hangs or fails ->
ParamSyncError naming it, and the weight directories it keeps."""

from __future__ import annotations

import re
import threading
import time

import pytest

from fully_async.config import AlgorithmConfig, SimTrainerConfig, TrainerConfig
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync, ParamSyncError
from fully_async.trace import Tracer, load
from fully_async.training.sim_backend import SimBackend
from fully_async.weights.base import SyncPlan
from fully_async.weights.disk import DiskTransport
from tests.fakes import StubRollouter


@pytest.fixture
def backend():
    return SimBackend(TrainerConfig(backend="sim", sim=SimTrainerConfig(time_scale=1e4)), AlgorithmConfig())


def _sync(stub, backend, tmp_path, timeout_s=5.0, tracer=None, mode="blocking"):
    handle = LocalActor(stub)
    return handle, ParamSync(handle, backend, tmp_path / "weights", "float32", timeout_s, tracer, mode=mode)


def test_a_sync_runs_its_phases_in_order_times_and_traces_each(backend, tmp_path):
    stub = StubRollouter()
    tracer = Tracer(tmp_path, "trainer")
    handle, sync = _sync(stub, backend, tmp_path, tracer=tracer)
    try:
        first, second = sync.sync(1), sync.sync(2)
    finally:
        handle.close()
        tracer.close()
    assert [c[0] for c in stub.calls] == ["pause", "load_weights", "resume"] * 2
    assert stub.calls[1] == ("load_weights", str(tmp_path / "weights" / "v1"), 1)
    assert (tmp_path / "weights" / "v1" / "sim_weights.json").is_file()
    phases = ["export", "pause", "distribute", "reload", "resume"]  # the export runs before the pause
    for t, names in ((first, ["connect", *phases]), (second, phases)):  # the transport is prepared once
        assert sorted(k for k in t if k.startswith("timing_s/param_sync/")) == sorted(
            f"timing_s/param_sync/{p}" for p in names
        )
        assert t["timing_s/param_sync"] >= sum(t[f"timing_s/param_sync/{p}"] for p in names)
    spans, _ = load(tmp_path)
    assert [s.name for s in spans if s.lane == "sync"] == ["connect", *phases, *phases]


@pytest.mark.parametrize("phase,method", [("pause", "pause"), ("reload", "load_weights"), ("resume", "resume")])
def test_a_phase_that_hangs_fails_the_sync_naming_it_within_the_timeout(backend, tmp_path, phase, method):
    handle, sync = _sync(StubRollouter(delays={method: 2.0}), backend, tmp_path, timeout_s=0.2)
    start = time.monotonic()
    try:
        with pytest.raises(ParamSyncError, match=f"phase '{phase}' did not finish within .*sync_timeout_s=0.2s"):
            sync.sync(1)
    finally:
        handle.close()
        sync.close()
    assert time.monotonic() - start < 1.5


def test_a_phase_that_fails_names_the_phase_and_the_cause(backend, tmp_path):
    stub = StubRollouter(fail={"load_weights": RuntimeError("vllm-0 answered HTTP 500")})
    handle, sync = _sync(stub, backend, tmp_path)
    try:
        with pytest.raises(ParamSyncError, match="phase 'reload' failed: RuntimeError: vllm-0 answered HTTP 500"):
            sync.sync(1)
    finally:
        handle.close()
    assert [c[0] for c in stub.calls] == ["pause", "load_weights"]  # nothing resumes on weights that did not load


def test_the_previous_version_is_kept_for_a_restarted_server_older_ones_removed(backend, tmp_path):
    handle, sync = _sync(StubRollouter(), backend, tmp_path)
    try:
        for v in (1, 2, 3):
            sync.sync(v)
    finally:
        handle.close()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"]


def test_a_hung_phase_is_left_in_a_daemon_thread_that_cannot_hold_the_interpreter_exit(backend, tmp_path):
    # A phase whose peer never answers stays blocked in its thread; Python joins non-daemon threads (and pool
    # workers) at exit, so such a thread once kept a finished CI run alive until its time limit.
    handle, sync = _sync(StubRollouter(delays={"pause": 3.0}), backend, tmp_path, timeout_s=0.1)
    try:
        with pytest.raises(ParamSyncError, match="phase 'pause' did not finish"):
            sync.sync(1)
        hung = [t for t in threading.enumerate() if t.name == "param-sync-pause" and t.is_alive()]
        assert hung and all(t.daemon for t in hung)
        # Later phases get a thread of their own: they do not queue behind the hung one (3 s against 0.1 s).
        assert sync.phases.run("probe", {}, lambda: 7) == 7
    finally:
        handle.close()
        sync.close()


# ---- async_training.sync_mode=background ----------------------------------------------------------------------------
def test_background_the_trainer_waits_for_the_export_only_and_for_the_last_sync_before_the_next(backend, tmp_path):
    reload_held = threading.Event()
    stub = StubRollouter(delays={"load_weights": 0.4}, gates={"load_weights": reload_held})
    tracer = Tracer(tmp_path, "trainer")
    handle, sync = _sync(stub, backend, tmp_path, tracer=tracer, mode="background")
    try:
        first = sync.sync(1)
        # It returned while the engines' reload was still held (a sync that waited for it would have failed: the gate
        # opens only below).
        assert stub.version == 0 and not reload_held.is_set()
        threading.Timer(0.3, reload_held.set).start()
        assert (tmp_path / "weights" / "v1" / "sim_weights.json").is_file()  # exported before it returned
        assert sorted(k for k in first if k.startswith("timing_s/param_sync/")) == [
            "timing_s/param_sync/connect",
            "timing_s/param_sync/export",
        ]
        second = sync.sync(2)  # due before the first finished: waits for it, timed as its own phase
        # The first sync had resumed the engines before the second exported.
        assert [c[0] for c in stub.calls][:3] == ["pause", "load_weights", "resume"]
        assert second["timing_s/param_sync/wait"] > 0.2
        for p in ("pause", "distribute", "reload", "resume", "background"):
            assert f"timing_s/param_sync/{p}" in second, p  # the first sync's phases, collected by this wait
        assert second["timing_s/param_sync"] >= second["timing_s/param_sync/wait"]
        last = sync.wait()
        assert last["timing_s/param_sync/reload"] >= 0.4
        assert sync.wait() == {}  # nothing in flight
    finally:
        handle.close()
        tracer.close()
    assert [c[0] for c in stub.calls] == ["pause", "load_weights", "resume"] * 2
    assert [c[2] for c in stub.calls if c[0] == "load_weights"] == [1, 2] and stub.version == 2
    spans, _ = load(tmp_path)
    assert [s.name for s in spans if s.lane == "sync"] == ["connect", "export", "pause", "distribute", "reload",
                                                           "resume", "export", "pause", "distribute", "reload",
                                                           "resume"]  # fmt: skip


@pytest.mark.parametrize("how", ["fails", "hangs"])
def test_background_a_reload_that_fails_or_hangs_fails_the_next_call_naming_the_phase(backend, tmp_path, how):
    if how == "fails":
        stub, match = StubRollouter(fail={"load_weights": RuntimeError("HTTP 500")}), "phase 'reload' failed"
    else:
        stub, match = StubRollouter(delays={"load_weights": 3.0}), "phase 'reload' did not finish within"
    handle, sync = _sync(stub, backend, tmp_path, timeout_s=0.3, mode="background")
    try:
        start = time.monotonic()
        try:
            sync.sync(1)
        except ParamSyncError as e:  # a reload that fails at once can fail before the reading phase is collected
            assert how == "fails" and re.search(match, str(e))
        with pytest.raises(ParamSyncError, match=f"background sync of version 1: weight sync {match}"):
            sync.wait()
        assert time.monotonic() - start < 1.5  # within the phase's timeout, not the hung call's
        for call in (sync.check, lambda: sync.sync(2)):  # and every later call: the run cannot go on
            with pytest.raises(ParamSyncError, match=match):
                call()
    finally:
        handle.close()
        sync.close()
    assert "resume" not in [c[0] for c in stub.calls]  # nothing resumes on weights that did not load


def test_an_unknown_sync_mode_is_a_config_error_naming_the_key(backend, tmp_path):
    from fully_async.config import ConfigError

    with pytest.raises(ConfigError, match="async_training.sync_mode must be one of"):
        _sync(StubRollouter(), backend, tmp_path, mode="later")


class _QueuingTransport(DiskTransport):
    """The disk transport over a backend whose export only queues the copy (as the verl backend's ranks do): here
    the sim backend's export, run whole, stands for the queuing call; where each phase ran is noted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ran_in: dict[str, str] = {}

    def plan(self, version, background):
        plan = super().plan(version, background)

        def noted(name, fn):
            def run():
                self.ran_in[name] = threading.current_thread().name
                return fn()

            return name, run

        return SyncPlan(
            queue=tuple(noted(n, f) for n, f in plan.reads),
            ahead=tuple(noted(n, f) for n, f in plan.ahead),
            engines=tuple(noted(n, f) for n, f in plan.engines),
        )


def test_background_reading_phases_that_only_queue_run_in_the_callers_thread_and_leave_nothing_to_wait_for(
    backend, tmp_path
):
    stub = StubRollouter(delays={"load_weights": 0.3})
    handle = LocalActor(stub)
    transport = _QueuingTransport(handle, backend, tmp_path / "weights", "float32")
    sync = ParamSync(handle, backend, tmp_path / "weights", "float32", 5.0, transport=transport, mode="background")
    try:
        started = sync.start(1)
        assert transport.ran_in["export"] == threading.current_thread().name  # before start returned
        assert "timing_s/param_sync/export" in started
        assert not sync.reading and sync.weights_read() == {}  # the next update goes on at once
        done = sync.wait()
        assert done["timing_s/param_sync/reload"] >= 0.3 and "timing_s/param_sync/export" not in done
        assert transport.ran_in["reload"] == "param-sync-reload"
    finally:
        handle.close()
        sync.close()
    assert [c[0] for c in stub.calls] == ["pause", "load_weights", "resume"] and stub.version == 1


def _stuck_rollouter(tmp_path, overrides: list[str]):
    """A real Rollouter (engine=sim) behind a LocalActor, started, with its pool's membership lock taken by a holder
    that never lets go (as a stuck restart would); (handle, release)."""
    import asyncio

    from fully_async.config import compose, to_dict
    from fully_async.message_queue import MessageQueue
    from fully_async.models import resolve_model_path
    from fully_async.rollouter import Rollouter
    from tests.helpers import SIM_ROLLOUT

    cfg = compose([*SIM_ROLLOUT, "engine.num_servers=2", *overrides])
    queue = LocalActor(MessageQueue(cfg.async_training.effective_queue_capacity(), 1), "queue")
    rollouter = Rollouter(to_dict(cfg), str(resolve_model_path(cfg.model)), str(tmp_path / "run"), queue)
    handle = LocalActor(rollouter, "rollouter")
    handle.start.remote().result(60)
    release = threading.Event()

    async def stuck_holder():
        async with rollouter.servers.membership:
            await asyncio.to_thread(release.wait, 30)

    asyncio.run_coroutine_threadsafe(stuck_holder(), handle._loop)
    time.sleep(0.2)
    return handle, queue, release


def _stuck_sync_error(backend, tmp_path, overrides: list[str], timeout_s: float) -> str:
    """The error of a sync into `_stuck_rollouter` under advanced.sync_timeout_s = `timeout_s`."""
    handle, queue, release = _stuck_rollouter(tmp_path, overrides)
    sync = ParamSync(handle, backend, tmp_path / "weights", "float32", timeout_s)
    try:
        with pytest.raises(ParamSyncError) as failed:
            sync.sync(1)
    finally:
        release.set()
        sync.close()
        handle.shutdown.remote().result(30)
        handle.close()
        queue.close()
    return str(failed.value)


@pytest.mark.timeout(120)
def test_a_sync_stuck_in_reload_fails_with_the_rollouters_tasks_the_lock_holder_and_the_control_calls(
    backend, tmp_path
):
    """Issue 46: a stuck sync shows where it is stuck without a debugger. The phase's timeout (4 s) comes before the
    lock's own bound (engine.control_timeout_s + 3 x control_deadline_s): the error carries the Rollouter's pending
    tasks down to the lock they wait on, who holds the lock, and each server's last control calls."""
    first, rest = _stuck_sync_error(backend, tmp_path, [], 4.0).split("\n", 1)
    assert "phase 'reload' did not finish within advanced.sync_timeout_s=4s" in first
    assert "pending asyncio tasks" in rest
    assert "in ControlPlane.load_weights\n" in rest and "in NamedLock.__aenter__" in rest  # the waiter's chain
    assert re.search(r"membership lock: held by .*stuck_holder .* for \d", rest)
    assert "last control calls per engine server:\n" in rest  # (none here: an idle pause calls no server)


@pytest.mark.timeout(120)
def test_a_membership_lock_held_past_its_bound_fails_the_reload_naming_the_holder(backend, tmp_path):
    """The lock's own bound (here 0.5 + 3 x 0.1 s) comes before the sync's (10 s): the reload fails at once, naming
    the lock, the waiter and the holder."""
    start = time.monotonic()
    text = _stuck_sync_error(backend, tmp_path, ["engine.control_timeout_s=0.5", "engine.control_deadline_s=0.1"], 10.0)
    assert time.monotonic() - start < 15.0  # the rollouter's start-up included; the sync's own bound is 10 s
    assert re.search(r"phase 'reload' failed: .*LockWaitTimeout: the engine pool's membership lock was not free "
                     r"within 0.8 s for ControlPlane.load_weights .*: held by .*stuck_holder", text)  # fmt: skip
