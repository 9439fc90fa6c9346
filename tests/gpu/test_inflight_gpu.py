"""async_training.on_sync on a vLLM server on a GPU (skipped without CUDA; the CPU twin, the same assertions on
vLLM-CPU and SGLang-CPU, is tests/integration/test_engine_servers.py
`test_requests_frozen_across_a_reload_keep_their_tokens_and_exact_versions`): requests in flight at a reload to other
weights are frozen, never sent again, finish with their whole budget and exact per-token versions; under recompute the
tokens after the sync are the new weights' greedy continuation, under keep they attend to the old weights' KV."""

from __future__ import annotations

import dataclasses

import pytest

from fully_async.config import EngineConfig
from fully_async.engines import build_engine
from fully_async.models import build_tiny_model
from tests.helpers import frozen_across_a_reload
from tests.integration.test_engine_servers import TINY

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1200)]

LONG = 384


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    cache = tmp_path_factory.mktemp("models")
    models = build_tiny_model(TINY, cache), build_tiny_model(dataclasses.replace(TINY, seed=1), cache)
    cfg = EngineConfig(num_servers=1, max_model_len=512, startup_timeout_s=600, control_timeout_s=60,
                       gpu_memory_utilization=0.3)  # fmt: skip
    servers = build_engine(cfg, models[0], tmp_path_factory.mktemp("run"), device="cuda")
    servers.start()
    yield servers, models
    servers.stop()


@pytest.mark.parametrize("on_sync", ["recompute", "keep"])
async def test_requests_frozen_across_a_reload_on_a_gpu(setup, on_sync):
    servers, (base, new) = setup
    prompts = [list(b"hello world") + [i] for i in range(4)]
    await frozen_across_a_reload(servers, base, new, on_sync, prompts, LONG, settle_s=0.02)  # a GPU is fast
