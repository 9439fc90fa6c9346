"""The collective weight transport without an engine server: bucket layout, packing with overlap, the engine-side
plan check, and a whole sync over a real gloo group whose receivers are the vLLM worker extension's own methods
running in threads of this process (a stand-in model runner records what would be loaded)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from fully_async.engines.vllm import EXTENSION_DIR
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync, ParamSyncError
from fully_async.vllm_ext.fa_digest import digest
from fully_async.weights.collective import CollectiveTransport
from fully_async.weights.collective_sender import (
    CollectiveSender,
    TransportError,
    layout_buckets,
    make_plan,
    pack_and_send,
)
from fully_async.weights.verify import VERIFIED_METRIC
from tests.fakes import EnginePortByName


def _receiver_module():
    spec = importlib.util.spec_from_file_location("fa_weight_receiver", EXTENSION_DIR / "fa_weight_receiver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


receiver = _receiver_module()


def test_layout_keeps_plan_order_fills_buckets_up_to_the_limit_and_gives_a_big_tensor_its_own():
    plan = make_plan([("a", (2, 3)), ("b", (4,)), ("big", (10, 10)), ("c", (1,))])
    buckets = layout_buckets(plan, "float32", bucket_bytes=40)  # 10 float32 elements per bucket
    assert [[t[0] for t in b["tensors"]] for b in buckets] == [["a", "b"], ["big"], ["c"]]
    assert buckets[0]["tensors"] == [["a", [2, 3], 0, 6], ["b", [4], 6, 4]]
    assert [b["numel"] for b in buckets] == [10, 100, 1]
    assert len(layout_buckets(plan, "bfloat16", bucket_bytes=40)[0]["tensors"]) == 2  # 20 bf16: a, b (big is 100)
    with pytest.raises(TransportError, match="engine dtype 'int8' cannot be sent"):
        layout_buckets(plan, "int8", 40)


class _Work:
    def __init__(self, log, k):
        self.log, self.k = log, k

    def wait(self):
        self.log.append(("wait", self.k))


def test_packing_casts_into_flat_buckets_and_packs_the_next_bucket_while_the_previous_is_on_the_wire():
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4), "c": torch.full((3,), 2.5)}
    buckets = layout_buckets(make_plan((k, v.shape) for k, v in tensors.items()), "bfloat16", bucket_bytes=20)
    log, sent = [], []

    def broadcast(flat):
        sent.append(flat.clone())
        log.append(("send", len(sent) - 1))
        return _Work(log, len(sent) - 1)

    stats = pack_and_send(iter(tensors.items()), buckets, "bfloat16", "cpu", broadcast)
    assert [len(b["tensors"]) for b in buckets] == [2, 1]
    assert all(s.dtype == torch.bfloat16 for s in sent)
    assert torch.equal(sent[0], torch.cat([tensors["a"].reshape(-1), tensors["b"]]).bfloat16())
    assert torch.equal(sent[1], tensors["c"].bfloat16())
    # bucket 1 went out before bucket 0 was waited for (two buffers alternate): packing overlaps the wire
    assert log == [("send", 0), ("send", 1), ("wait", 0), ("wait", 1)]
    assert stats["bytes"] == (10 + 3) * 2
    # a caller that keeps the buffers packs the next send into the same (already touched) memory
    kept: list = []
    pack_and_send(iter(tensors.items()), buckets, "bfloat16", "cpu", broadcast, kept)
    first = [b.data_ptr() for b in kept]
    pack_and_send(iter(tensors.items()), buckets, "bfloat16", "cpu", broadcast, kept)
    assert len(first) == 2 and [b.data_ptr() for b in kept] == first


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"a": torch.ones(2), "x": torch.ones(3)}, "yielded tensor 'x' where the plan has 'b'"),
        ({"a": torch.ones(2), "b": torch.ones(4)}, r"tensor 'b' has shape \[4\], the plan has \[3\]"),
        ({"a": torch.ones(2), "b": torch.ones(3, dtype=torch.int64)}, "tensor 'b' is torch.int64"),
        ({"a": torch.ones(2)}, "ran out of tensors before 'b'"),
        ({"a": torch.ones(2), "b": torch.ones(3), "z": torch.ones(1)}, "more tensors than the plan"),
    ],
)
def test_packing_refuses_a_sender_that_departs_from_the_plan_naming_the_tensor(tensors, message):
    buckets = layout_buckets([["a", [2]], ["b", [3]]], "float32", bucket_bytes=8)
    works = []

    def broadcast(flat):
        works.append(_Work([], len(works)))
        return works[-1]

    with pytest.raises(TransportError, match=message):
        pack_and_send(iter(tensors.items()), buckets, "float32", "cpu", broadcast)


def test_engine_side_plan_check_names_missing_and_misshapen_tensors():
    headers = {"w": [4, 2], "v": [3]}
    assert receiver.check_plan([["w", [4, 2]], ["v", [3]]], headers) == []
    assert receiver.check_plan([["w", [4, 3]], ["u", [3]]], headers) == [
        "tensor 'w' has shape [4, 3], the engine's checkpoint has [4, 2]",
        "tensor 'u' is not in the engine's checkpoint",
    ]


# ---- a whole sync over a real gloo group, receivers in threads ----------------------------------------------------
class _ModelConfig:
    def __init__(self, model):
        self.model = str(model)


class _Runner:
    """Stands in for vLLM's model runner: keeps what reload_weights was given (copied as each tensor arrives, with
    the time). `hold=True` copies only at the end, holding the views meanwhile, as vLLM's layerwise reload does for
    a layer it cannot finish before later tensors arrive."""

    def __init__(self, hold: bool = False):
        self.loaded: dict[str, torch.Tensor] | None = None
        self.at: dict[str, float] = {}
        self.hold = hold

    def reload_weights(self, weights_iterator):
        self.loaded = {}
        held = []
        for name, t in weights_iterator:
            self.at[name] = time.monotonic()
            if self.hold:
                held.append((name, t))
            else:
                self.loaded[name] = t.clone()
        self.loaded.update({name: t.clone() for name, t in held})


class _Worker(receiver.WeightReceiver):
    def __init__(self, model_dir, hold: bool = False):
        self.model_config, self.model_runner = _ModelConfig(model_dir), _Runner(hold)


class _ThreadEngines(EnginePortByName):
    """The Rollouter's weight-sync calls, each server one extension worker in a thread of this process."""

    def __init__(self, workers):
        self.workers, self.epoch, self.version, self.received = workers, 0, 0, []

    def layout(self):
        servers = [{"index": i, "url": f"http://127.0.0.1:{9000 + i}", "workers": 1} for i in range(len(self.workers))]
        return {"epoch": self.epoch, "servers": servers}

    async def rpc(self, index, method, spec, timeout_s):
        return [await asyncio.to_thread(getattr(self.workers[index], method), spec)]

    async def rpc_all(self, method, spec):
        """The proof's fan-out (weights/verify.py): every worker's answer, by its server's URL."""
        urls = [s["url"] for s in self.layout()["servers"]]
        return {url: await self.rpc(i, method, spec, 10) for i, url in enumerate(urls)}

    def unverifiable(self):
        return ""

    async def weights_received(self, version, epoch):
        self.version = version
        self.received.append((version, epoch))

    async def pause(self):
        pass

    async def resume(self):
        pass


class _Backend:
    def __init__(self, state):
        self.state = state

    def weight_sender(self):
        return CollectiveSender(lambda: iter(self.state.items()))


def _one_worker_sync(model_dir, state, tmp_path, hold=False, **kwargs):
    worker = _Worker(model_dir, hold)
    engines = _ThreadEngines([worker])
    handle = LocalActor(engines)
    transport = CollectiveTransport(handle, _Backend(state), tmp_path / "w", "float32", sync_timeout_s=20, **kwargs)
    return worker, engines, handle, ParamSync(handle, None, tmp_path / "w", "float32", 20.0, transport=transport)


@pytest.fixture
def checkpoint(tmp_path):
    state = {"model.embed.weight": torch.randn(16, 8), "model.norm.weight": torch.randn(8),
             "lm_head.weight": torch.randn(16, 8)}  # fmt: skip
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path, state


def test_a_sync_over_gloo_delivers_every_tensor_to_every_worker_and_labels_the_version(checkpoint, tmp_path):
    model_dir, state = checkpoint
    new = {k: v + 1.0 for k, v in state.items()}
    workers = [_Worker(model_dir), _Worker(model_dir)]
    engines = _ThreadEngines(workers)
    handle = LocalActor(engines)
    transport = CollectiveTransport(handle, _Backend(new), tmp_path / "w", "bfloat16", bucket_mb=1e-4,
                                    sync_timeout_s=20)  # fmt: skip
    sync = ParamSync(handle, None, tmp_path / "w", "bfloat16", 20.0, transport=transport)
    try:
        timings = sync.sync(3)
        for w in workers:
            assert list(w.model_runner.loaded) == list(new)
            for name, t in new.items():
                assert torch.equal(w.model_runner.loaded[name], t.bfloat16())
        assert engines.received == [(3, 0)] and engines.version == 3
        assert {"timing_s/param_sync/connect", "timing_s/param_sync/send", "timing_s/param_sync/set_version"} <= set(
            timings
        )
        assert len(transport.last["engines"]) == 2 and transport.last["sender"]["bytes"] > 0
        # proven: each worker's digest of what its loader took is the sender's of what it packed (bf16, as sent)
        sent = transport.last["sender"]["digest"]
        assert sent == digest((k, v.bfloat16()) for k, v in new.items()) and timings[VERIFIED_METRIC] == 2
        assert [w.fa_loaded_digest()["digest"] for w in workers] == [sent, sent]
        # a server restarted meanwhile (epoch bumped): the next sync re-forms the group first, then sends
        engines.epoch = 1
        workers[1].model_runner.loaded = None
        sync.sync(4)
        assert workers[1].model_runner.loaded is not None and engines.received[-1] == (4, 1)
    finally:
        sync.close(remove=False)
        handle.close()


class _Garbled:
    """A worker's group whose received buckets arrive with their first element changed (a load gone wrong on one
    server: the engine holds other values than were sent)."""

    def __init__(self, pg):
        self.pg = pg

    def broadcast(self, buf, root):
        work = self.pg.broadcast(buf, root)

        class _Then:
            def wait(self):
                work.wait()
                buf.view(-1)[0] += 1.0  # the first element of a bucket is a sample of its first tensor

        return _Then()


def test_a_server_that_received_other_values_fails_the_verify_phase_naming_it_before_the_version_is_set(
    checkpoint, tmp_path
):
    model_dir, state = checkpoint
    workers = [_Worker(model_dir), _Worker(model_dir)]
    engines = _ThreadEngines(workers)
    handle = LocalActor(engines)
    transport = CollectiveTransport(handle, _Backend(state), tmp_path / "w", "float32", sync_timeout_s=20)
    sync = ParamSync(handle, None, tmp_path / "w", "float32", 20.0, transport=transport)
    try:
        sync.sync(1)
        workers[1]._fa["pg"] = _Garbled(workers[1]._fa["pg"])
        with pytest.raises(ParamSyncError, match=r"'verify' failed.*weights v2 did not land on 1 of 2") as failed:
            sync.sync(2)
        assert "http://127.0.0.1:9001 loaded digest" in str(failed.value) and ":9000" not in str(failed.value)
        assert engines.received == [(1, 0)]  # unproven weights are never labelled with the version
    finally:
        sync.close(remove=False)
        handle.close()


def test_a_plan_that_does_not_fit_fails_before_any_byte_moves_naming_the_tensor(checkpoint, tmp_path):
    model_dir, state = checkpoint
    bad = dict(state)
    bad["model.norm.weight"] = torch.randn(9)
    workers = [_Worker(model_dir)]
    engines = _ThreadEngines(workers)
    handle = LocalActor(engines)
    sync = ParamSync(handle, None, tmp_path / "w", "float32", 20.0, transport=CollectiveTransport(
        handle, _Backend(bad), tmp_path / "w", "float32", sync_timeout_s=20))  # fmt: skip
    try:
        with pytest.raises(ParamSyncError, match=r"'connect' failed.*tensor 'model.norm.weight' has shape \[9\]"):
            sync.sync(1)
        assert workers[0].model_runner.loaded is None and getattr(workers[0], "_fa", None) is None
    finally:
        sync.close(remove=False)
        handle.close()


def test_a_sender_that_dies_mid_send_fails_the_phase_naming_the_mix_and_the_next_sync_loads_everything(
    checkpoint, tmp_path
):
    model_dir, state = checkpoint
    new = {k: v + 1.0 for k, v in state.items()}
    calls = []

    def dying():  # the first pass (the plan) is whole; the first send dies after one tensor
        calls.append(1)
        items = list(new.items())
        yield from items[:1] if len(calls) == 2 else items
        if len(calls) == 2:
            raise RuntimeError("trainer rank died")

    backend = _Backend(state)
    workers = [_Worker(model_dir)]
    engines = _ThreadEngines(workers)
    handle = LocalActor(engines)
    transport = CollectiveTransport(handle, backend, tmp_path / "w", "float32", bucket_mb=1e-4, sync_timeout_s=4)
    transport.sender.named_tensors = dying
    sync = ParamSync(handle, None, tmp_path / "w", "float32", 30.0, transport=transport)
    try:
        with pytest.raises(ParamSyncError, match=r"'send' failed.*trainer rank died.*http://127.0.0.1:9000.*"
                           r"1 of 3 tensors were loaded, so this server holds a mix of weight versions"):  # fmt: skip
            sync.sync(1)
        # streamed: the bucket that arrived was loaded (vLLM finishes its reload on what it got), no version set
        assert list(workers[0].model_runner.loaded) == ["model.embed.weight"] and engines.version == 0
        sync.sync(2)  # the group is re-formed and the whole version sent
        assert all(torch.equal(workers[0].model_runner.loaded[k], v) for k, v in new.items())
        assert engines.version == 2
    finally:
        sync.close(remove=False)
        handle.close()
    assert not [t for t in threading.enumerate() if t.name in ("weight-sender", "fa-weight-receive")]


def test_the_engine_loads_each_bucket_while_the_next_is_on_the_wire(checkpoint, tmp_path):
    model_dir, state = checkpoint
    calls = []

    def slow_last():  # the plan pass is whole; the send holds its last tensor back for a while
        calls.append(1)
        items = list(state.items())
        yield from items[:-1]
        if len(calls) > 1:
            time.sleep(1.0)
        yield items[-1]

    worker, engines, handle, sync = _one_worker_sync(model_dir, state, tmp_path, bucket_mb=1e-4)
    sync.transport.sender.named_tensors = slow_last
    try:
        sync.sync(1)
    finally:
        sync.close(remove=False)
        handle.close()
    at = worker.model_runner.at
    assert at["lm_head.weight"] - at["model.embed.weight"] > 0.8  # the first bucket was loaded before the last came
    answer = sync.transport.last["engines"][0][0]
    assert answer["buckets"] == 3 and answer["stall_s"] > 0.8


def test_bucket_buffers_are_reused_across_syncs_only_when_no_view_of_them_is_alive(checkpoint, tmp_path):
    pool = receiver.BucketPool(torch.float32, torch.device("cpu"))
    a = pool.take(10)
    held = a[2:4]
    del a
    b = pool.take(8)  # the first buffer is still referred to by `held`: a second one
    assert b.data_ptr() != held.data_ptr() - 8 and pool.fresh == 2
    del held, b
    assert pool.take(10).data_ptr() == pool.buffers[0].data_ptr() and pool.fresh == 2
    # whole syncs, one bucket per tensor, more buckets than the pool keeps: a runner that holds every view until the
    # end still gets the right values (a buffer in use is never received into: fresh ones are allocated); a runner
    # that copies as it goes stops allocating once the pool is full
    state = {f"t{i}": torch.randn(8, 4) for i in range(receiver.POOL_KEEP + 2)}
    save_file(state, str(tmp_path / "model.safetensors"))
    for hold in (True, False):
        new = {k: v * 3.0 for k, v in state.items()}
        worker, engines, handle, sync = _one_worker_sync(tmp_path, new, tmp_path / str(hold), hold, bucket_mb=1e-4)
        fresh = []
        try:
            for version in (1, 2, 3):
                sync.sync(version)
                assert all(torch.equal(worker.model_runner.loaded[k], v) for k, v in new.items())
                fresh.append(sync.transport.last["engines"][0][0]["fresh_buffers"])
        finally:
            sync.close(remove=False)
            handle.close()
        if hold:
            assert fresh == [len(state)] + [len(state) - receiver.POOL_KEEP] * 2
        else:  # the pool fills up, then buffers are reused; which are busy when depends on the threads' timing (gloo's
            # finished work can hold its tensor a moment after wait() returns), so allow one stray allocation
            assert fresh[0] <= receiver.POOL_KEEP and fresh[-1] <= 1


def test_when_the_watchdog_fires_first_its_message_names_the_servers_still_receiving(checkpoint, tmp_path):
    model_dir, state = checkpoint
    calls = []

    def stalling():  # the plan pass is whole; the send stalls before its first tensor
        calls.append(1)
        if len(calls) > 1:
            time.sleep(4)
        yield from state.items()

    workers = [_Worker(model_dir)]
    engines = _ThreadEngines(workers)
    handle = LocalActor(engines)
    transport = CollectiveTransport(handle, _Backend(state), tmp_path / "w", "float32", sync_timeout_s=6)
    transport.sender.named_tensors = stalling
    sync = ParamSync(handle, None, tmp_path / "w", "float32", 1.0, transport=transport)
    try:
        with pytest.raises(ParamSyncError, match=r"'send' did not finish.*not answering: http://127.0.0.1:9000"):
            sync.sync(1)
    finally:
        sync.close(remove=False)
        handle.close()


def test_json_is_all_that_crosses_to_the_engine(checkpoint, tmp_path):
    """The receiver's arguments are JSON strings (vLLM's collective_rpc passes only strings; no pickle)."""
    model_dir, _ = checkpoint
    w = _Worker(model_dir)
    assert w.fa_check(json.dumps({"tensors": [["lm_head.weight", [16, 8]]]})) == {"tensors": 1}
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' has shape"):
        w.fa_check(json.dumps({"tensors": [["lm_head.weight", [8, 16]]]}))


@pytest.mark.needs_venv(".venv-engine")
def test_every_vllm_engine_gets_the_extension_and_imports_it_alone(tmp_path):
    """Every reload goes through the extension (fa_reload digests what the loader takes), so every vLLM server loads
    it, whatever the transport; its interpreter imports it (and fa_digest beside it) with nothing of ours."""
    import subprocess

    from fully_async.config import EngineConfig
    from fully_async.engines import build_engine

    for servers in (build_engine(EngineConfig(), tmp_path, tmp_path, device="cpu"),):
        cmd, env = servers.kind.command(0, 8000), servers.kind.environment(0)
        assert cmd[cmd.index("--worker-extension-cls") + 1] == "fa_weight_receiver.WeightReceiver"
        assert env["PYTHONPATH"] == str(EXTENSION_DIR)
    # the engine's interpreter finds the class on that path, with nothing of ours importable
    probe = ("import fa_weight_receiver as m, importlib.util as u; "
             "print(m.WeightReceiver.__name__, m.Digest.__name__, u.find_spec('fully_async'))")  # fmt: skip
    out = subprocess.run([cmd[0], "-c", probe], env={"PYTHONPATH": env["PYTHONPATH"]}, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)  # fmt: skip
    assert out.stdout.split() == ["WeightReceiver", "Digest", "None"], out.stderr[-2000:]


class _GatedPauseEngines(_ThreadEngines):
    """The engines' part (from their pause on) starts only while `gate` is open: a test closes it to act between the
    trainer's return and the engines' receive, instead of racing a sleep."""

    def __init__(self, workers):
        super().__init__(workers)
        self.gate = threading.Event()
        self.gate.set()

    async def pause(self):
        if not await asyncio.to_thread(self.gate.wait, 20.0):
            raise TimeoutError("the engines' pause was held 20 s: the trainer's call waited for it")


@pytest.mark.parametrize("staging", ["device", "pinned"])
def test_background_the_engines_get_the_staged_copy_while_the_trainer_changes_its_weights(
    checkpoint, tmp_path, capsys, staging
):
    """Both staging places (advanced.staging) run here on CPU: `device` broadcasts the staging buffers,
    `pinned` copies them through the two send buffers (the nccl path's code; host memory on CPU)."""
    model_dir, state = checkpoint
    live = {k: v.clone() for k, v in state.items()}  # the trainer's parameters, changed in place by its next step
    readers: set[str] = set()

    class Reading(_Backend):
        def weight_sender(self):
            def tensors():
                for item in live.items():
                    readers.add(threading.current_thread().name)
                    yield item

            return CollectiveSender(tensors)

    worker = _Worker(model_dir)
    engines = _GatedPauseEngines([worker])
    handle = LocalActor(engines)
    transport = CollectiveTransport(handle, Reading(live), tmp_path / "w", "float32", bucket_mb=1e-4,
                                    sync_timeout_s=20, staging=staging)  # fmt: skip
    sync = ParamSync(handle, None, tmp_path / "w", "float32", 20.0, transport=transport, mode="background")
    try:
        for version in (1, 2):
            expected = {k: v.clone() for k, v in live.items()}
            engines.gate.clear()  # the engines' part waits: the trainer's call must return without it
            timings = sync.sync(version)
            assert "timing_s/param_sync/stage" in timings
            assert engines.version == version - 1  # not live before its reload (here: receive) finished
            for t in live.values():  # the next optimizer step, before the engines receive
                t.add_(100.0)
            engines.gate.set()
            done = sync.wait()
            assert {"timing_s/param_sync/send", "timing_s/param_sync/set_version"} <= set(done)
            assert done[VERIFIED_METRIC] == 1  # proven against the digest taken at stage, not the changed weights
            assert engines.version == version
            for name, t in expected.items():
                assert torch.equal(worker.model_runner.loaded[name], t), name
    finally:
        sync.close(remove=False)
        handle.close()
    shown = [line for line in capsys.readouterr().out.splitlines() if "stages a copy of the weights" in line]
    size = sum(t.numel() for t in state.values()) * 4
    assert len(shown) == 1 and f"({size} bytes, float32)" in shown[0]  # once per run, with its size
    assert f"advanced.staging={staging}" in shown[0]
    assert ("plain host memory" in shown[0]) == (staging == "pinned")  # and where: on CPU pinned is not pinned
    sender = transport.sender
    assert all(b.device.type == "cpu" and not b.is_pinned() for b in sender.staging)
    # pinned sends through the two bucket buffers; device sends the staging buffers themselves and packs none
    assert len(sender.buffers) == (2 if staging == "pinned" else 0)
    # The weights were read only by the phases the trainer waits for (each runs in a watchdog thread of its own).
    assert readers == {"param-sync-connect", "param-sync-stage"}


@pytest.mark.parametrize("restart", ["before_stage", "after_stage"])
def test_background_a_server_restarted_before_the_send_gets_the_staged_copy_in_a_group_re_formed_off_the_trainer(
    checkpoint, tmp_path, restart
):
    """The pool changes (epoch bumped, as a restart does) between two syncs, or after the trainer staged version 2
    and before the engines receive it: the trainer's `stage` does not wait for a re-form (its broadcast goes to the
    old group); `send`, in ParamSync's thread, re-forms the group and broadcasts the staged copy again, and every
    worker gets it."""
    model_dir, state = checkpoint
    live = {k: v.clone() for k, v in state.items()}
    workers = [_Worker(model_dir), _Worker(model_dir)]
    engines = _GatedPauseEngines(workers)
    handle = LocalActor(engines)
    transport = CollectiveTransport(handle, _Backend(live), tmp_path / "w", "float32", bucket_mb=1e-4,
                                    sync_timeout_s=20)  # fmt: skip
    sync = ParamSync(handle, None, tmp_path / "w", "float32", 20.0, transport=transport, mode="background")
    try:
        sync.sync(1)
        sync.wait()
        group = transport._group
        if restart == "before_stage":
            engines.epoch = 1
        expected = {k: v + 1.0 for k, v in live.items()}
        for t in live.values():
            t.add_(1.0)
        engines.gate.clear()
        sync.sync(2)  # staged; the engines' part waits for the gate
        assert transport._group == group  # the trainer's phase formed nothing
        if restart == "after_stage":
            engines.epoch = 1
        for t in live.values():
            t.add_(100.0)  # the trainer's next step
        engines.gate.set()
        done = sync.wait()
        assert transport._group != group  # re-formed, and the staged copy (not the changed tensors) sent
        assert "timing_s/param_sync/send" in done and engines.received == [(1, 0), (2, 1)]
        for w in workers:
            for name, t in expected.items():
                assert torch.equal(w.model_runner.loaded[name], t), name
    finally:
        sync.close(remove=False)
        handle.close()
