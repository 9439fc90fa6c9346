"""The SGLang adapter without a server (fully_async/engines/sglang.py): its command line and environment on CPU and
GPU, request and response shapes, and the CPU import shims. The real server: tests/integration/test_engine_servers.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fully_async.config import ConfigError, EngineConfig, compose
from fully_async.engines import Sampling, build_engine, sglang
from fully_async.engines.sglang import SHIMS, SGLangKind, kv_tokens


def _servers(model, tmp_path, python, device, **kw):
    cfg = EngineConfig(kind="sglang", python=python, **kw)
    return build_engine(cfg, model, tmp_path, device=device)


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_cpu_command_and_environment_follow_the_recipe(model, tmp_path, python):
    s = _servers(model, tmp_path, python, "cpu", kv_cache_gib=2, extra_args=["--x"], env={"A": "1"})
    assert isinstance(s.kind, SGLangKind)
    cmd = s.kind.command(0, 4321, "127.0.0.1")
    assert cmd[:3] == [python, "-m", "sglang.launch_server"] and cmd[-1] == "--x"
    assert _flag(cmd, "--port") == "4321" and _flag(cmd, "--device") == "cpu" and _flag(cmd, "--dtype") == "float32"
    assert _flag(cmd, "--attention-backend") == "torch_native" and _flag(cmd, "--sampling-backend") == "pytorch"
    assert {"--skip-tokenizer-init", "--sleep-on-idle", "--disable-overlap-schedule"} <= set(cmd)
    assert "--tp" not in cmd
    assert _flag(cmd, "--max-total-tokens") == str(kv_tokens(model, 2))
    env = s.kind.environment(0)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PYTHONPATH"] == str(SHIMS) and env["A"] == "1"
    assert env["VIRTUAL_ENV"] == str(tmp_path / "venv")


def test_gpu_command_has_tp_and_memory_fraction_and_no_cpu_shims(model, tmp_path, python):
    s = _servers(model, tmp_path, python, "cuda", tensor_parallel_size=2, gpu_memory_utilization=0.5)
    cmd = s.kind.command(0, 1)
    assert _flag(cmd, "--tp") == "2" and _flag(cmd, "--mem-fraction-static") == "0.5"
    assert _flag(cmd, "--dtype") == "bfloat16" and "--disable-cuda-graph" in cmd
    assert "--device" not in cmd and "--sleep-on-idle" not in cmd
    env = s.kind.environment(0)
    assert "SGLANG_USE_CPU_ENGINE" not in env and env["PYTHONPATH"] == ""


def test_kv_tokens_from_the_models_kv_size(model, tmp_path):
    # default tiny model: 2 layers x 2 kv heads x 32 head dim x (K and V) x 4 bytes = 1 KiB per token
    assert kv_tokens(model, 1) == 2**30 // (2 * 2 * 2 * 32 * 4)
    assert kv_tokens(model, 1, "bfloat16") == 2 * kv_tokens(model, 1)
    assert kv_tokens(tmp_path / "elsewhere", 1) == 65536  # a path only another node can read


def test_missing_venv_is_a_config_error_naming_the_setup_command(model, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="engine.python must be an existing interpreter with SGLang"):
        build_engine(EngineConfig(kind="sglang", python=str(tmp_path / "nope")), model, tmp_path, device="cpu")
    monkeypatch.setattr(sglang, "SGLANG_VENV", tmp_path / "no-venv")
    with pytest.raises(ConfigError, match="setup_engine_env.sh --sglang"):
        build_engine(EngineConfig(kind="sglang"), model, tmp_path, device="cpu")


def test_engine_kind_accepts_sglang_and_names_the_kinds_otherwise():
    assert compose(["engine=sglang"]).engine.kind == "sglang"
    with pytest.raises(ConfigError, match=r"engine.kind must be one of \['vllm', 'sglang', 'sim'\]"):
        compose(["engine.kind=sglng"])


def test_generate_request_is_token_level_with_output_logprobs_only(model, tmp_path, python):
    s = _servers(model, tmp_path, python, "cpu")
    path, body = s.kind.generate_request([5, 6, 7], 9, Sampling(temperature=0.7, seed=3, stop_token_ids=(2,)))
    assert path == "/generate" and body["input_ids"] == [5, 6, 7]
    assert body["return_logprob"] is True and body["logprob_start_len"] == 3
    p = body["sampling_params"]
    assert p["max_new_tokens"] == 9 and p["temperature"] == 0.7 and p["sampling_seed"] == 3
    assert p["stop_token_ids"] == [2]


def _response(ids, finish, spans):
    lps = [[-0.5 - i, t, None] for i, t in enumerate(ids)]
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": lps, "finish_reason": finish,
                                             "weight_versions": spans}}  # fmt: skip


def test_parse_generate_reads_tokens_logprobs_finish_and_per_token_versions(model, tmp_path, python):
    s = _servers(model, tmp_path, python, "cpu")
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    seg = s.kind.parse_generate(_response([11, 12, 13], {"type": "length", "length": 3}, spans))
    assert seg.token_ids == [11, 12, 13] and seg.logprobs == [-0.5, -1.5, -2.5]
    assert seg.versions == [3, 3, 4] and seg.finish_reason == "length"
    aborted = s.kind.parse_generate(_response([1], {"type": "abort", "message": "Aborted"}, [{"version": "default",
                                                                                          "start": 0, "end": 1}]))  # fmt: skip
    assert aborted.finish_reason == "abort" and aborted.versions == [None]
    assert s.kind.parse_generate(_response([2], {"type": "stop", "matched": 2}, [])).finish_reason == "stop"
    with pytest.raises(ValueError, match="log-probs"):
        s.kind.parse_generate({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]],
                                                              "finish_reason": {"type": "length"}}})  # fmt: skip
    with pytest.raises(ValueError, match="unknown finish_reason"):
        s.kind.parse_generate(_response([1], {"type": "weird"}, []))


def test_control_calls(model, tmp_path, python):
    s = _servers(model, tmp_path, python, "cpu")
    assert s.kind.pause_call("abort").json == {"mode": "abort"} and s.kind.pause_call("keep").json == {
        "mode": "in_place"
    }
    assert s.kind.resume_call().path == "/continue_generation"
    reload = s.kind.reload_weights_call(tmp_path)
    assert reload.path == "/update_weights_from_disk" and reload.json["model_path"] == str(tmp_path)
    assert reload.check({"success": True}) is None and "refused" in reload.check({"success": False, "message": "x"})
    version = s.kind.set_version_call(7)
    assert version.json == {"new_version": "7", "abort_all_requests": False}
    assert s.kind.reset_prefix_cache_call().path == "/flush_cache"


SHIM_CHECK = """
import torch, pytest
from sgl_kernel import assign_req_to_token_pool_cpu, some_cuda_op
import torchvision
from torchvision.transforms import InterpolationMode
import torchvision.transforms.v2.functional as tvF
from torchvision.io import decode_jpeg
mode = InterpolationMode.BICUBIC  # attribute access at import time must work
for fn in (some_cuda_op, tvF.resize, decode_jpeg):
    with pytest.raises(NotImplementedError):
        fn()
req_to_token = torch.zeros(3, 6, dtype=torch.int32)
assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]), torch.tensor([3, 2]),
                             torch.tensor([7, 8, 9, 10], dtype=torch.int64), 6)
assert req_to_token.tolist() == [[9, 10, 0, 0, 0, 0], [0] * 6, [0, 7, 8, 0, 0, 0]], req_to_token.tolist()
print("ok")
"""


def test_cpu_shims_import_as_placeholders_and_assign_req_to_token_pool_writes_each_requests_slots():
    out = subprocess.run([sys.executable, "-c", SHIM_CHECK], env={"PYTHONPATH": str(SHIMS)}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize(
    ("options", "vllm_flags", "sglang_flags"),
    [
        ({}, [], []),
        ({"enable_chunked_prefill": True, "max_num_batched_tokens": 4096},
         ["--enable-chunked-prefill", "--max-num-batched-tokens", "4096"], ["--chunked-prefill-size", "4096"]),
        ({"enable_chunked_prefill": False}, ["--no-enable-chunked-prefill"], ["--chunked-prefill-size", "-1"]),
    ],
)  # fmt: skip
def test_engine_options_verl_sets_reach_both_engines_servers(
    model, tmp_path, python, options, vllm_flags, sglang_flags
):
    """engine.enable_chunked_prefill / max_num_batched_tokens (verl's actor_rollout_ref.rollout keys) in each engine's
    spelling; SGLang has no switch for chunked prefill on (its default) and caps a step's prefill by its chunk size."""
    for kind, want in (("vllm", vllm_flags), ("sglang", sglang_flags)):
        cmd = build_engine(
            EngineConfig(kind=kind, python=python, **options), model, tmp_path, device="cpu"
        ).kind.command(0, 4321, "127.0.0.1")
        found = [a for a in cmd if "chunked-prefill" in a or "batched-tokens" in a]
        found += [cmd[cmd.index(a) + 1] for a in found if a in ("--max-num-batched-tokens", "--chunked-prefill-size")]
        assert sorted(found) == sorted(want), (kind, cmd)
