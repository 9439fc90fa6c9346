"""The proof of a sync (fully_async/weights/verify.py) against servers on 127.0.0.1 (tests/fakes.FakeEngine, which
digests the directory it reloads as the real extension does): every server that loaded the expected tensors is
returned with its digest; one that answers another digest, and one that does not answer within
engine.control_deadline_s, fail the check, each named, the honest ones not; an engine kind that cannot report a
digest (engine=sim) fails the check instead of passing it, and the transports' `verify` phase is skipped for it with
one line."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from safetensors.torch import save_file

from fully_async.config import EngineConfig
from fully_async.engines import build_engine
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync, ParamSyncError
from fully_async.weights.disk import files_digest
from fully_async.weights.verify import VERIFIED_METRIC, check_answers, verify_engines
from tests.fakes import FakeEngine, ServersRollouter, StateDictBackend

pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 1.0


@pytest.fixture
def weights(tmp_path):
    out = tmp_path / "v1"
    out.mkdir()
    save_file({"a.weight": torch.randn(64, 32), "b.bias": torch.randn(32)}, str(out / "model.safetensors"))
    return out


@pytest.fixture
async def fakes():
    started = [await FakeEngine().start(), await FakeEngine().start(), await FakeEngine("silent").start()]
    yield started
    for fake in started:
        await fake.stop()


def _handle(urls):
    servers = build_engine(EngineConfig(control_deadline_s=DEADLINE_S, control_timeout_s=30), "/nonexistent", "/tmp",
                           addresses=urls)  # fmt: skip
    return servers, LocalActor(ServersRollouter(servers))


async def test_verify_engines_returns_every_matching_server_and_names_a_lying_and_a_silent_one(fakes, weights):
    ok, liar, silent = fakes
    servers, handle = _handle([ok.url, liar.url])
    try:
        await servers.control.reload_indices(weights, {}, [0, 1])
        expected = files_digest(weights)
        got = await asyncio.to_thread(verify_engines, handle, expected, "fa_loaded_digest", {}, "weights v1")
        assert got == {ok.url: expected, liar.url: expected}
        liar.lie_digest = "0" * 32
        with pytest.raises(ParamSyncError, match=r"weights v1 did not land on 1 of 2") as failed:
            await asyncio.to_thread(verify_engines, handle, expected, "fa_loaded_digest", {}, "weights v1")
        assert f"{liar.url} loaded digest {'0' * 32}" in str(failed.value) and ok.url not in str(failed.value)
    finally:
        handle.close()
    servers, handle = _handle([ok.url, silent.url])
    try:
        start = time.monotonic()
        with pytest.raises(ParamSyncError, match=r"weights v1 did not land on 1 of 2") as failed:
            await asyncio.to_thread(verify_engines, handle, expected, "fa_loaded_digest", {}, "weights v1")
        assert time.monotonic() - start < DEADLINE_S + 2.0  # the control deadline bounded the silent server
        assert f"{silent.url} did not answer" in str(failed.value) and ok.url not in str(failed.value)
        assert servers.serving == [0, 1]  # judged by the caller, not set aside by the fan-out
    finally:
        handle.close()


async def test_a_disk_sync_into_a_server_whose_load_went_astray_fails_its_verify_phase_naming_it(fakes, tmp_path):
    ok, liar, _ = fakes
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.randn(8, 8)}, str(model / "model.safetensors"))
    servers, handle = _handle([ok.url, liar.url])
    sync = ParamSync(handle, StateDictBackend(model), tmp_path / "w", "float32", 30.0, transport="disk")
    try:
        timings = await asyncio.to_thread(sync.sync, 1)
        assert timings[VERIFIED_METRIC] == 2 and "timing_s/param_sync/verify" in timings
        assert ok.digest_queries == liar.digest_queries == 0  # the reload's own answers carried the digests
        liar.lie_digest = "f" * 32
        with pytest.raises(ParamSyncError, match=r"phase 'verify' failed.*weights v2 did not land on 1 of 2") as e:
            await asyncio.to_thread(sync.sync, 2)
        assert liar.url in str(e.value) and ok.url not in str(e.value)
    finally:
        sync.close()
        handle.close()


async def test_a_recorded_digest_that_is_not_the_files_is_caught_by_what_the_engine_loaded(fakes, tmp_path):
    """The disk side compares the digest its writer recorded in the index (nothing read back); the engine digests
    the tensors it loaded. A record that does not describe the files fails the proof on every server."""
    import json

    from fully_async.training.hf_files import DIGEST_KEY, INDEX, write_safetensors

    ok, _, _ = fakes
    write_safetensors([("w", torch.randn(8, 8))], tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    index["metadata"][DIGEST_KEY] = "e" * 32  # a writer whose record went astray
    (tmp_path / INDEX).write_text(json.dumps(index))
    servers, handle = _handle([ok.url])
    try:
        await servers.control.reload_indices(tmp_path, {}, [0])
        with pytest.raises(ParamSyncError, match=r"did not land on 1 of 1"):
            await asyncio.to_thread(verify_engines, handle, files_digest(tmp_path), "fa_loaded_digest", {}, "v1")
    finally:
        handle.close()


def test_an_engine_kind_without_a_digest_fails_the_check_and_the_transport_skips_verify_saying_so(tmp_path, capsys):
    servers = build_engine(EngineConfig(kind="sim", num_servers=2), "/nonexistent", tmp_path)
    handle = LocalActor(ServersRollouter(servers))
    try:
        with pytest.raises(ParamSyncError, match="weights v1: cannot verify the sync: engine=sim holds no weights"):
            verify_engines(handle, "x", "fa_loaded_digest", {}, "weights v1")
        model = tmp_path / "model"
        model.mkdir()
        save_file({"w": torch.randn(4)}, str(model / "model.safetensors"))
        sync = ParamSync(handle, StateDictBackend(model), tmp_path / "w", "float32", 30.0, transport="disk")
        timings = sync.sync(1)
        sync.sync(2)
        sync.close()
    finally:
        handle.close()
    assert "timing_s/param_sync/verify" not in timings and VERIFIED_METRIC not in timings
    out = capsys.readouterr().out
    assert out.count("weight syncs are not verified by a digest: engine=sim holds no weights") == 1


def test_verifying_a_sync_with_no_serving_server_left_finds_nothing_to_prove_and_does_not_fail(caplog):
    """A node lost mid-sync sets its servers aside (the reload goes on without them); when that leaves no serving
    server, the verify phase has nothing to ask: it says so and raises nothing (the servers that come back are
    brought to the current version before they serve), instead of failing a run the elastic pool would save."""
    with caplog.at_level(logging.WARNING, logger="fully_async.weights.verify"):
        assert check_answers(None, {}, "d" * 32, "weights v7") == {}
    assert "weights v7: no serving engine server to verify the sync on" in caplog.text
