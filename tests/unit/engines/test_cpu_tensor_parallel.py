"""engine.tensor_parallel_size > 1 on CPU without a server: the vLLM-CPU command line, the per-rank core binding
(VLLM_CPU_OMP_THREADS_BIND, one range per rank joined by '|'), the worker count the collective transport's world is
made of, and the refusals before Ray. The real TP=2 server: tests/integration/test_vlm_tensor_parallel.py (long)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fully_async.config import ConfigError, EngineConfig, compose
from fully_async.device import cpu_binding, engine_cpus
from fully_async.engines import build_engine, vllm
from fully_async.preflight import check_cpu_tensor_parallel


def _vlm_dir(tmp_path):
    """A model directory that says it is a Qwen2-VL (all the adapter reads of it)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    return tmp_path


def _kind(tmp_path, python, device="cpu", **kw):
    cfg = EngineConfig(python=python, **kw)
    return build_engine(cfg, _vlm_dir(tmp_path), tmp_path, device=device).kind


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_each_rank_gets_its_own_cores():
    assert cpu_binding(0, 1, [0, 1], ranks=2) == "0|1"  # this machine: no spare core, round-robin single cores
    assert [cpu_binding(i, 2, [0, 1, 2, 3, 4, 5, 6, 7, 8], ranks=2) for i in range(2)] == ["0,1|2,3", "4,5|6,7"]
    assert [cpu_binding(i, 2, [0, 1, 2, 3], ranks=2) for i in range(2)] == ["0|1", "2|3"]
    assert cpu_binding(1, 2, [0, 1, 2, 3, 4]) == "2,3"  # one rank: unchanged, no '|'
    assert engine_cpus(2, [0, 1, 2, 3, 4, 5, 6, 7, 8], ranks=2) == set(range(8))
    assert engine_cpus(1, [0, 1, 2, 3], ranks=2) == {0, 1}


def test_a_tp2_cpu_server_is_started_with_two_ranks_bound_apart(tmp_path, python, monkeypatch):
    monkeypatch.setattr(vllm, "host_cpus", lambda: [0, 1])
    kind = _kind(tmp_path, python, tensor_parallel_size=2)
    assert kind.workers_per_server == 2  # the collective transport's world: 1 + 2 per server
    cmd = kind.command(0, 4321)
    assert _flag(cmd, "--tensor-parallel-size") == "2" and "--gpu-memory-utilization" not in cmd
    assert _flag(cmd, "--limit-mm-per-prompt") is not None  # the VLM's flags stay beside it
    env = kind.environment(0)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    one = _kind(tmp_path, python)
    assert one.workers_per_server == 1 and "--tensor-parallel-size" not in one.command(0, 4321)
    assert one.environment(0)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_the_gpu_command_keeps_its_tp(tmp_path, python):
    kind = _kind(tmp_path, python, device="cuda", tensor_parallel_size=4)
    assert kind.workers_per_server == 4 and _flag(kind.command(0, 1), "--tensor-parallel-size") == "4"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in kind.environment(0)


def test_sglang_on_cpu_stays_one_rank(tmp_path, python):
    kind = build_engine(EngineConfig(kind="sglang", python=python, tensor_parallel_size=2), tmp_path, tmp_path,
                        device="cpu").kind  # fmt: skip
    assert kind.workers_per_server == 1


def _run_cfg(base, device="cpu", **engine):
    return dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, device=device),
                               engine=dataclasses.replace(base.engine, **engine))  # fmt: skip


def test_cpu_tp_that_cannot_work_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    base = compose([])
    check_cpu_tensor_parallel(_run_cfg(base, tensor_parallel_size=2), cpus=2)  # one core per rank: fine
    with pytest.raises(ConfigError, match=r"engine.tensor_parallel_size=3 on CPU .* may use 2; allowed: 1 to 2"):
        check_cpu_tensor_parallel(_run_cfg(base, tensor_parallel_size=3), cpus=2)
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size=2 needs GPUs with engine.kind=sglang"):
        check_cpu_tensor_parallel(_run_cfg(base, kind="sglang", tensor_parallel_size=2), cpus=2)
    # On GPUs the ranks are GPUs (placement checks those); emulated engines have no ranks.
    check_cpu_tensor_parallel(_run_cfg(base, "cuda", tensor_parallel_size=8), cpus=2)
    check_cpu_tensor_parallel(_run_cfg(base, kind="sim", tensor_parallel_size=8), cpus=2)
