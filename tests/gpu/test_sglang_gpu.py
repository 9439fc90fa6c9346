"""SGLang on real GPUs (skipped without CUDA; the CPU twin of the contract is tests/integration/test_engine_servers.py):
a server with `--tp 2`, and the NCCL weight path (`/init_weights_update_group` + `/update_weights_from_distributed`,
NCCL-only in SGLang, so it cannot run on the CPU machines).

Needs 2 GPUs and SGLang for CUDA in .venv-sglang (`bash scripts/setup_engine_env.sh --sglang` on the GPU machine:
with CUDA it installs sglang as SGLang documents). Not run on the project's CPU machines or CI.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from fully_async.config import EngineConfig, TinyModelConfig
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.engines.process import free_port
from fully_async.engines.sglang import SGLANG_VENV, init_weights_group, update_weights_from_distributed
from fully_async.models import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not (SGLANG_VENV / "bin/python").exists(), reason="SGLang venv .venv-sglang missing"),
]

TINY = TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536, init_std=0.1)
CFG = EngineConfig(
    kind="sglang", num_servers=1, tensor_parallel_size=2, gpu_memory_utilization=0.3, startup_timeout_s=600
)
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
PROMPTS = [list(b"12+34="), list(b"hello world"), list(b"7*8 is")]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    return build_tiny_model(TINY, cache), build_tiny_model(dataclasses.replace(TINY, seed=1), cache)


@pytest.fixture(scope="module")
def tp2(models, tmp_path_factory):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs for --tp 2")
    servers = build_engine(CFG, models[0], tmp_path_factory.mktemp("run"), device="cuda")
    assert "--tp" in (cmd := servers.kind.command(0, 1)) and cmd[cmd.index("--tp") + 1] == "2"
    servers.start()
    yield servers
    servers.stop()


async def _greedy(servers, n=24):
    client = EngineClient(servers)
    outs = [(await client.generate(p, n, GREEDY)) for p in PROMPTS]
    await client.close()
    return outs


async def test_tp2_greedy_is_deterministic_and_a_disk_reload_changes_outputs_and_versions(tp2, models):
    first, again = await _greedy(tp2), await _greedy(tp2)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    await tp2.pause("abort")
    await tp2.load_weights(models[1], 1)
    await tp2.resume()
    reloaded = await _greedy(tp2)
    assert [o.token_ids for o in reloaded] != [o.token_ids for o in first]
    assert all(o.versions == [1] * 24 for o in reloaded)


async def test_nccl_weight_update_equals_a_disk_reload_of_the_same_weights(tp2, models):
    """The caller is rank 0 of a weight-update group with the server's 2 ranks; it broadcasts the new weights (bf16,
    the server's dtype) while /update_weights_from_distributed receives them."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    base, new = models
    await tp2.pause("abort")
    await tp2.load_weights(new, 2)
    await tp2.resume()
    via_disk = [o.token_ids for o in await _greedy(tp2)]
    await tp2.pause("abort")
    await tp2.load_weights(base, 3)
    await tp2.resume()

    port, group = free_port(), "fully_async_test"
    world = 1 + CFG.tensor_parallel_size
    joined = asyncio.create_task(init_weights_group(tp2, "127.0.0.1", port, group))
    await asyncio.to_thread(
        dist.init_process_group, backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=0
    )
    await joined
    try:
        state = {k: v.to("cuda:0", torch.bfloat16) for k, v in load_file(new / "model.safetensors").items()}
        names = list(state)
        await tp2.pause("abort")
        received = asyncio.create_task(
            update_weights_from_distributed(
                tp2, names, ["bfloat16"] * len(names), [list(state[n].shape) for n in names], group, 4
            )
        )

        def send():
            for n in names:
                dist.broadcast(state[n], src=0)
            torch.cuda.synchronize()

        await asyncio.to_thread(send)
        await received
        await tp2.resume()
    finally:
        dist.destroy_process_group()
    via_nccl = await _greedy(tp2)
    assert [o.token_ids for o in via_nccl] == via_disk
    assert all(o.versions == [4] * 24 for o in via_nccl)
