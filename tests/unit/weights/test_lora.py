"""The adapter sync without a real engine: which runs sync adapters and which fall back to merged weights
(weights/lora.py `adapter_sync_plan`), the LoRA flags of vLLM and SGLang servers, the digest in vLLM's layout, and
the SGLang calls of a whole adapter sync (load, activate, generate under the adapter, unload when no request names
it) against a stand-in SGLang server on 127.0.0.1 (tests/fakes.FakeSGLangLora; SGLang's CPU engine cannot run LoRA,
the real GPU test is tests/gpu/test_lora_gpu.py). The real vLLM-CPU server: tests/integration/test_lora_sync.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from fully_async.config import ConfigError, EngineConfig, FullyAsyncConfig
from fully_async.engines import EngineClient, EngineError, Sampling, build_engine
from fully_async.handles import LocalActor
from fully_async.sync import ParamSync
from fully_async.vllm_ext.fa_digest import digest
from fully_async.vllm_ext.fa_lora import folded, scaling
from fully_async.weights.base import SyncPlan, WeightTransport
from fully_async.weights.lora import LoraServing, adapter_sync_plan
from tests.fakes import FakeSGLangLora, StubRollouter


def _cfg(rank: int = 8, sync: str = "auto", kind: str = "vllm", staleness: int = 1) -> FullyAsyncConfig:
    cfg = FullyAsyncConfig()
    cfg.model.lora.rank, cfg.model.lora.sync, cfg.engine.kind = rank, sync, kind
    cfg.async_training.max_staleness = staleness
    return cfg


def test_adapters_serve_where_they_can_sized_by_the_staleness_bound_and_the_smallest_allowed_rank():
    assert adapter_sync_plan(_cfg(rank=0), "cpu") == (None, "")
    serving, why = adapter_sync_plan(_cfg(rank=10, staleness=3), "cpu")
    assert why == "" and serving == LoraServing(max_loras=5, max_rank=16, target_modules=("all-linear",))
    assert serving.max_cpu_loras == 7
    assert adapter_sync_plan(_cfg(kind="sglang"), "cuda")[0] is not None


@pytest.mark.parametrize(
    ("cfg", "device", "reason"),
    [
        (_cfg(sync="merged"), "cpu", "model.lora.sync=merged"),
        (_cfg(kind="sim"), "cpu", "engine=sim"),
        (_cfg(kind="sglang"), "cpu", "SGLang's CPU engine crashes with LoRA"),
        (_cfg(rank=1024, sync="merged"), "cpu", "model.lora.sync=merged"),
    ],
)
def test_where_adapters_cannot_serve_versions_go_merged_with_the_reason(cfg, device, reason):
    serving, why = adapter_sync_plan(cfg, device)
    assert serving is None and reason in why


def test_sync_adapter_where_it_cannot_work_is_a_config_error_naming_the_key_and_the_reason():
    with pytest.raises(ConfigError, match="model.lora.sync=adapter cannot work here: engine=sim"):
        adapter_sync_plan(_cfg(kind="sim", sync="adapter"), "cpu")


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_vllm_servers_start_with_runtime_lora_loading_and_the_worker_extension(model, tmp_path, python):
    cfg = EngineConfig(python=python)
    plain = build_engine(cfg, model, tmp_path, device="cpu")
    assert "--enable-lora" not in plain.kind.command(
        0, 1
    ) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.kind.environment(0)
    s = build_engine(cfg, model, tmp_path, device="cpu", lora=LoraServing(max_loras=3, max_rank=16))
    cmd = s.kind.command(0, 1)
    assert "--enable-lora" in cmd and _flag(cmd, "--max-loras") == "3" and _flag(cmd, "--max-cpu-loras") == "5"
    assert _flag(cmd, "--max-lora-rank") == "16" and _flag(cmd, "--worker-extension-cls").startswith("fa_weight")
    env = s.kind.environment(0)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["PYTHONPATH"].endswith("vllm_ext")


def test_sglang_servers_on_gpus_start_with_lora_flags(model, tmp_path, python):
    cfg = EngineConfig(kind="sglang", python=python)
    serving = LoraServing(max_loras=3, max_rank=8, target_modules=("all-linear",))
    cmd = build_engine(cfg, model, tmp_path, device="cuda", lora=serving).kind.command(0, 1)
    assert "--enable-lora" in cmd and _flag(cmd, "--max-lora-rank") == "8"
    assert _flag(cmd, "--max-loras-per-batch") == "3" and _flag(cmd, "--max-loaded-loras") == "5"
    assert _flag(cmd, "--lora-target-modules") == "all"


def test_the_digest_in_vllm_layout_scales_lora_b_as_vllm_folds_it():
    a, b = torch.randn(8, 32), torch.randn(64, 8)
    named = [("base_model.model.m.lora_A.weight", a), ("base_model.model.m.lora_B.weight", b)]
    assert scaling({"r": 8, "lora_alpha": 12}) == 1.5 and scaling({"r": 16, "lora_alpha": 8, "use_rslora": True}) == 2
    folded_b = b.clone()
    folded_b *= 1.5  # what vLLM's LoRALayerWeights.optimize does to the tensor it loaded
    want = digest([("base_model.model.m.lora_A.weight", a), ("base_model.model.m.lora_B.weight", folded_b)])
    assert digest(folded(named, 1.5)) == want != digest(named)
    assert torch.equal(named[1][1], b)  # the file's tensors are left as they are
    assert digest(folded(named, 1.0)) == digest(named)


def _adapter(tmp_path, name: str):
    out = tmp_path / name
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    return out


async def test_sglang_adapter_sync_calls_and_the_unload_rule_against_a_stand_in_server(model, tmp_path, python):
    fake = await FakeSGLangLora(token_delay_s=0.01).start()
    cfg = EngineConfig(kind="sglang", python=python, control_deadline_s=5, control_timeout_s=5)
    pool = build_engine(cfg, model, tmp_path, addresses=[fake.url], device="cuda", lora=LoraServing(2, 8))
    adapters = pool.weights.adapters
    client = EngineClient(pool)
    try:
        base = await client.generate([1, 2], 3, Sampling(temperature=0.0))
        assert fake.calls == [("generate", None)] and base.versions == [0, 0, 0]
        await adapters.load("policy-v1", _adapter(tmp_path, "v1"))
        await adapters.activate("policy-v1", 1)
        v1 = await client.generate([1, 2], 3, Sampling(temperature=0.0))
        assert fake.calls[-1] == ("generate", "policy-v1") and v1.versions == [1, 1, 1]
        assert list(v1.token_ids) == [t + 1 for t in base.token_ids]
        # A request on v1 stays in flight while v2 and v3 are loaded and activated: v1 is older than the newest two
        # but named by a request, so it stays loaded; once the request is done the next unload takes it.
        slow = asyncio.ensure_future(client.generate([5], 40, Sampling(temperature=0.0)))
        while adapters.in_use.get("policy-v1") != 1:
            await asyncio.sleep(0.005)
        for v in (2, 3):
            await adapters.load(f"policy-v{v}", _adapter(tmp_path, f"v{v}"))
            await adapters.activate(f"policy-v{v}", v)
            kept = await adapters.unload()
        assert not slow.done() and kept == {"unloaded": [], "loaded": ["policy-v1", "policy-v2", "policy-v3"]}
        result = await slow
        assert set(result.versions) == {1} and adapters.in_use == {}
        assert await adapters.unload() == {"unloaded": ["policy-v1"], "loaded": ["policy-v2", "policy-v3"]}
        assert ("unload", "policy-v1") in fake.calls and set(fake.loaded) == {"policy-v2", "policy-v3"}
        # A directory without an adapter: the stand-in refuses it, and the load fails naming the server.
        with pytest.raises(EngineError, match=rf"load adapter policy-v4.*{fake.url}.*no adapter in"):
            await adapters.load("policy-v4", tmp_path / "missing")
        with pytest.raises(EngineError, match="'policy-v4' cannot be activated: it was not loaded"):
            await adapters.activate("policy-v4", 4)
        assert pool.state.version == 3 and adapters.current == "policy-v3"
    finally:
        await client.close()
        await fake.stop()


async def test_a_weights_directory_holding_an_adapter_is_loaded_and_activated_as_that_version(model, tmp_path, python):
    # What a resumed run's Rollouter.start does with its checkpoint's export; the resumed job itself is
    # tests/integration/test_verl_lora.py.
    fake = await FakeSGLangLora().start()
    cfg = EngineConfig(kind="sglang", python=python, control_deadline_s=5, control_timeout_s=5)
    pool = build_engine(cfg, model, tmp_path, addresses=[fake.url], device="cuda", lora=LoraServing(2, 8))
    try:
        await pool.load_weights(_adapter(tmp_path, "v5"), 5)  # what Rollouter.start does with a checkpoint's export
        assert fake.calls == [("load", "policy-v5")] and pool.state.version == 5
        assert pool.weights.adapters.current == "policy-v5" and pool.weights.adapters.acquire(5) == "policy-v5"
    finally:
        await fake.stop()


class _NoPauseTransport(WeightTransport):
    """A transport whose phases need no pause (as the adapter transport's): records what ran."""

    name = "no-pause"

    def __init__(self) -> None:
        self.ran: list[str] = []

    def prepare(self, rollouter) -> None:
        pass

    def plan(self, version: int, background: bool) -> SyncPlan:
        load = (("load", lambda: self.ran.append(f"load v{version}")),)
        if not background:
            return SyncPlan(engines=load, pause=False)
        return SyncPlan(reads=(("export", lambda: self.ran.append(f"export v{version}")),), engines=load, pause=False)

    def export(self, version: int):
        raise NotImplementedError

    def close(self, remove: bool = True) -> None:
        pass


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_param_sync_neither_pauses_nor_resumes_the_engines_for_a_transport_that_needs_no_pause(tmp_path, mode):
    stub = StubRollouter()
    handle = LocalActor(stub)
    transport = _NoPauseTransport()
    sync = ParamSync(handle, None, tmp_path, "float32", 10.0, transport=transport, mode=mode)
    try:
        timings = {**sync.sync(1), **sync.wait()}
    finally:
        sync.close()
        handle.close()
    assert stub.calls == [] and "timing_s/param_sync/pause" not in timings
    assert transport.ran == (["load v1"] if mode == "blocking" else ["export v1", "load v1"])
