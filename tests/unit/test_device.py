"""The one rule for the run's device and engine dtype, and the CPU split (fully_async/device.py)."""

from __future__ import annotations

import fully_async.device as rules
from fully_async.config import compose


def test_device_is_trainer_device_when_set_else_cuda_where_gpus_are(monkeypatch):
    monkeypatch.setattr(rules, "local_cuda", lambda: False)
    assert rules.device("cpu", cluster_gpus=8) == "cpu"  # the CPU twin of a GPU cluster: declared GPUs, CPU compute
    assert rules.device("cuda") == "cuda"
    assert rules.device("auto") == "cpu"
    assert rules.device("auto", cluster_gpus=4) == "cuda"  # a CPU head node driving GPU workers
    monkeypatch.setattr(rules, "local_cuda", lambda: True)
    assert rules.device("auto") == "cuda"


def test_engine_dtype_follows_the_device_unless_set():
    cfg = compose([])
    assert rules.engine_dtype(cfg, "cpu") == "float32" and rules.engine_dtype(cfg, "cuda") == "bfloat16"
    assert rules.engine_dtype(compose(["engine.dtype=float16"]), "cpu") == "float16"


def test_cpu_split_only_for_cpu_engines(monkeypatch):
    monkeypatch.setattr(rules, "host_cpus", lambda: [0, 1])
    assert rules.cpu_split(compose([]), "cpu") == ([0], [1])
    assert rules.cpu_split(compose([]), "cuda") == (None, None)
    assert rules.cpu_split(compose(["engine=sim"]), "cpu") == (None, None)
    monkeypatch.setattr(rules, "host_cpus", lambda: [0])
    assert rules.cpu_split(compose([]), "cpu") == (None, None)  # no core left for the trainer: no split
