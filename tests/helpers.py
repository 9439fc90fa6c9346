"""Builders of real protocol objects for tests (not fakes: these are the product's own dataclasses), and a reader of
the files a logger writes."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import numpy as np

from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as gone). A process that exits between the two looks is gone too:
    reading a vanished process's /proc stat raises ENOENT or ESRCH."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # ProcessLookupError included
        return False


SIM_ROLLOUT = [
    "engine=sim",
    "trainer=sim",
    "rollout.agent_loop=fully_async.agents.sim:SimAgentLoop",
    "reward.sources=[{kind: 'fully_async.reward.sim:score'}]",
    "rollout.n=4",
    "rollout.response_length=64",
    "engine.max_model_len=512",
    "engine.sim.length_median=20",
    "engine.sim.length_sigma=0.5",
    "engine.sim.decode_step_s=0.001",
    "engine.sim.decode_step_per_seq_s=0.0",
]
"""Config overrides of a small, fast rollout on emulated engines in this process (the sim agent loop and reward):
20-token responses at 1 ms a token, rollout.n=4."""


async def generate_across_a_sync(client, tmp_path: Path, prompt: list[int], budget: int, pause_after_s: float, *args):
    """The abort/continue contract every engine behind EngineClient keeps: a request started at version 0 and aborted
    by a pause after `pause_after_s` waits for the resume (weights reloaded as version 1) instead of failing or
    finishing early; returns its result. `args` go to generate after the budget (sampling)."""
    servers = client.servers
    await servers.set_version(0)
    task = asyncio.create_task(client.generate(prompt, budget, *args))
    await asyncio.sleep(pause_after_s)
    await servers.pause("abort")
    await asyncio.sleep(0.05)
    assert not task.done()  # waiting for the resume, not failing or finishing early
    await servers.load_weights(tmp_path, 1)
    await servers.resume()
    return await task


def make_group(index: int, version: int = 0, n: int = 2, response_len: int = 8, epoch: int = 0, prompt_len: int = 4):
    """A group of n trajectories whose tokens all carry `version`."""
    ref = PromptRef(epoch, index)
    trajs = [
        Trajectory(
            prompt=ref,
            sample_index=s,
            prompt_ids=np.arange(1, prompt_len + 1),
            response_ids=np.full(response_len, 7 + s),
            behaviour_logprobs=np.full(response_len, -0.5, dtype=np.float32),
            token_versions=np.full(response_len, version),
            start_version=version,
            reward=float(s % 2),
        )
        for s in range(n)
    ]
    return TrajectoryGroup(ref, trajs, meta={"data_source": "test", "ground_truth": str(index)})


def wandb_records(path: Path):
    """Records of a wandb transaction log (.wandb): a 7-byte header (':W&B', magic 0xBEE1, version), then LevelDB-log
    framed protobuf `Record`s in 32 KiB blocks (chunk header: crc32c, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a wandb transaction log"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def wandb_history(path: Path) -> list[dict]:
    """The logged rows (one per `run.log` call) of a wandb transaction log."""
    import json

    return [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in wandb_records(path)
        if r.WhichOneof("record_type") == "history"
    ]


def in_ci() -> bool:
    """Whether this run is CI's (.ci/run sets CI=true; so do the usual CI services): where a missing engine venv or
    tool fails a test instead of skipping it."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


async def frozen_across_a_reload(servers, base, new, on_sync: str, prompts: list, budget: int, settle_s: float):
    """The on_sync contract on a real engine (CPU: tests/integration/test_engine_servers.py; GPU:
    tests/gpu/test_inflight_gpu.py): `prompts` generate greedily at version 10 on `base`; the same requests, frozen
    by a pause in `on_sync`'s mode `settle_s` after they all run, meet a reload to `new` as version 11. Each must
    finish with its whole budget, never sent again, the tokens before the sync the old weights' greedy path labelled
    10 token by token and the rest 11; under recompute the rest is exactly the new weights' greedy continuation of
    prompt + those tokens (the KV recomputed), under keep it is not (it attends to the KV the old weights wrote) and
    every token records that cache's version."""
    from fully_async.engines import EngineClient, Sampling

    greedy = Sampling(temperature=0.0, ignore_eos=True)
    await servers.pause("abort")
    await servers.load_weights(base, 10)
    await servers.resume()
    servers.state.on_sync = on_sync
    client = EngineClient(servers)
    try:
        old = await asyncio.gather(*(client.generate(p, budget, greedy) for p in prompts))
        tasks = [asyncio.create_task(client.generate(p, budget, greedy)) for p in prompts]
        while sum(client.outstanding) < len(prompts):
            assert not any(t.done() for t in tasks), "a request ended before the pause"
            await asyncio.sleep(0.001)
        await asyncio.sleep(settle_s)
        assert await servers.pause(on_sync)
        await servers.load_weights(new, 11)
        await servers.resume()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        splits = [list(out.versions).count(10) for out in outs]
        conts = await asyncio.gather(*(client.generate(p + o.token_ids[:k], budget - k, greedy)
                                       for p, o, k in zip(prompts, outs, splits)))  # fmt: skip
    finally:
        servers.state.on_sync = "abort"
        await client.close()
    same = []
    for ref, out, k, cont in zip(old, outs, splits, conts):
        assert 0 < k < budget, "the pause must land mid-generation for this test to mean anything"
        assert len(out.token_ids) == budget and out.num_aborts == 0 and len(out.servers) == 1
        assert list(out.versions) == [10] * k + [11] * (budget - k)
        assert out.token_ids[:k] == ref.token_ids[:k]
        same.append(out.token_ids[k:] == cont.token_ids)
        assert out.cache_versions == (None if on_sync == "recompute" else [10] * budget)
    stats = client.stats
    assert stats.frozen_requests == len(prompts) and stats.client_reprefill_tokens == 0
    if on_sync == "recompute":
        assert all(same)
        assert stats.engine_reprefill_tokens == sum(len(p) + k for p, k in zip(prompts, splits))
    else:
        assert not all(same) and stats.engine_reprefill_tokens == 0
