"""The collective weight transport with nccl into real vLLM servers on GPUs (skipped without CUDA): the twin of
tests/integration/test_weights_collective.py, same code, only the backend (and the dtype) differ.

NCCL wants one device per rank: the sender (this process) uses cuda:0 and the engine server the next GPU, so it
needs 2 GPUs and `bash scripts/setup.sh` on the GPU machine (vllm with CUDA in .venv-engine)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import build_engine
from fully_async.handles import LocalActor
from fully_async.models import build_tiny_model
from fully_async.sync import ParamSync, ParamSyncError
from fully_async.weights.collective import CollectiveTransport
from tests.fakes import ServersRollouter, StateDictBackend
from tests.integration.test_weights_collective import TINY, _outputs

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1200)]

SYNC_TIMEOUT_S = 30.0


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # a CPU build of torch: no devices
        return 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs: one for the sender (this process), one for the engine")
    import dataclasses

    cache = tmp_path_factory.mktemp("models")
    models = build_tiny_model(TINY, cache), build_tiny_model(dataclasses.replace(TINY, seed=1), cache)
    cfg = EngineConfig(num_servers=1, max_model_len=256, startup_timeout_s=600, control_timeout_s=60,
                       gpu_memory_utilization=0.3, env={"CUDA_VISIBLE_DEVICES": "1"})  # fmt: skip
    fresh = build_engine(cfg, models[1], tmp_path_factory.mktemp("fresh"), device="cuda")
    fresh.start()
    try:
        reference = asyncio.run(_outputs(fresh, 0))
    finally:
        fresh.stop()
    servers = build_engine(cfg, models[0], tmp_path_factory.mktemp("run"), device="cuda")
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    yield models, reference, servers, handle
    handle.close()
    servers.stop()


def _sync(handle, backend, tmp_path) -> ParamSync:
    transport = CollectiveTransport(handle, backend, tmp_path / "w", "bfloat16", bucket_mb=1,
                                    sync_timeout_s=SYNC_TIMEOUT_S, device="cuda")  # fmt: skip
    assert transport.backend_name == "nccl"
    return ParamSync(handle, backend, tmp_path / "w", "bfloat16", SYNC_TIMEOUT_S, transport=transport)


def test_nccl_sync_equals_a_fresh_server_then_a_dead_sender_fails_in_time_then_a_restart_rejoins(setup, tmp_path):
    models, reference, servers, handle = setup
    sync = _sync(handle, StateDictBackend(models[1], device="cuda"), tmp_path)
    try:
        sync.sync(1)
    finally:
        sync.close(remove=False)
    got = asyncio.run(_outputs(servers, 0))
    for (tokens, logprobs, versions), (want_tokens, want_logprobs, _) in zip(got, reference):
        assert tokens == want_tokens and set(versions) == {1}
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-2

    dying = StateDictBackend(models[0], device="cuda")
    sync = _sync(handle, dying, tmp_path)
    sync.transport.prepare(handle)
    dying.die_after = 10
    start = time.monotonic()
    try:
        with pytest.raises(ParamSyncError, match="'send'"):
            sync.sync(2)
    finally:
        sync.close(remove=False)
    assert time.monotonic() - start < SYNC_TIMEOUT_S + 10

    sync = _sync(handle, StateDictBackend(models[1], device="cuda"), tmp_path)
    try:
        servers.restart(0)
        assert servers.stale == {0}
        sync.sync(3)
    finally:
        sync.close(remove=False)
    assert servers.stale == set()
    assert [r[0] for r in asyncio.run(_outputs(servers, 0))] == [r[0] for r in reference]


@pytest.mark.parametrize("staging", ["device", "pinned"])
def test_nccl_background_sync_sends_the_staged_copy_while_the_trainer_changes_its_weights(setup, tmp_path, staging):
    """The GPU twin of tests/unit/weights/test_collective.py's staged-copy test: the staging buffers on cuda:0
    (`device`), or in pinned host memory copied through the two bucket buffers on cuda:0 as they go out (`pinned`:
    nccl sends device memory only)."""
    models, reference, servers, handle = setup
    sync = _sync(handle, StateDictBackend(models[0], device="cuda"), tmp_path)  # the servers off the reference first
    try:
        sync.sync(4)
    finally:
        sync.close(remove=False)
    backend = StateDictBackend(models[1], device="cuda")
    transport = CollectiveTransport(handle, backend, tmp_path / "w", "bfloat16", bucket_mb=1,
                                    sync_timeout_s=SYNC_TIMEOUT_S, device="cuda", staging=staging)  # fmt: skip
    sync = ParamSync(handle, backend, tmp_path / "w", "bfloat16", SYNC_TIMEOUT_S, transport=transport,
                     mode="background")  # fmt: skip
    try:
        timings = sync.sync(5)
        assert "timing_s/param_sync/stage" in timings
        for t in backend.state.values():  # the next optimizer step, while the engines receive the staged copy
            t.add_(1.0)
        assert {"timing_s/param_sync/send", "timing_s/param_sync/set_version"} <= set(sync.wait())
        staged = backend.sender.staging
        if staging == "pinned":
            assert all(b.device.type == "cpu" and b.is_pinned() for b in staged)
            assert [b.device.type for b in backend.sender.buffers] == ["cuda", "cuda"]
        else:
            assert all(b.device.type == "cuda" for b in staged)
    finally:
        sync.close(remove=False)
    got = asyncio.run(_outputs(servers, 0))
    for (tokens, logprobs, versions), (want_tokens, want_logprobs, _) in zip(got, reference):
        assert tokens == want_tokens and set(versions) == {5}
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-2
