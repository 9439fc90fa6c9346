"""A verl platform for machines without an accelerator: FSDP2 on CPU over gloo.

verl 0.9.1 ships CUDA, NPU and ROCm platforms only and falls back to "nvidia" when none is present, after which every
process group asks for NCCL. Importing this module registers the platform "cpu" with verl's `PlatformRegistry`.
Ray workers get it through `worker_env()`: `VERL_USE_EXTERNAL_MODULES` makes `import verl` import this module in the
worker before anything asks for the platform, and `VERL_PLATFORM=cpu` selects it.

`VERL_ENGINE_DEVICE=cuda` is on purpose: verl registers its FSDP engine for the device names "cuda" and "npu" only;
the engine then asks the platform (this one) for the real device, which is "cpu".
"""

from __future__ import annotations

import contextlib

import torch
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM_NAME = "cpu"


class _CpuDeviceModule:
    """Stands in for `torch.cuda` where verl calls `get_torch_device()`: memory statistics read 0, the RNG is the CPU
    generator, everything else is forwarded to `torch.cpu`."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def max_memory_allocated(self, *args, **kwargs) -> int:
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    def mem_get_info(self, *args, **kwargs) -> tuple[int, int]:
        return (0, 0)

    def reset_peak_memory_stats(self, *args, **kwargs) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_name(self, *args, **kwargs) -> str:
        return "CPU"

    def get_rng_state(self, *args, **kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state, *args, **kwargs) -> None:
        torch.set_rng_state(state)


_DEVICE_MODULE = _CpuDeviceModule()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """CPU platform: device "cpu", collectives over gloo, Ray resource "CPU", no IPC."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        # False keeps verl's accelerator-only paths (CUDA RNG, pinned memory, IPC) off.
        return False

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, index) -> None:
        pass

    def synchronize(self, index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, n) -> dict:
        return {}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def worker_env() -> dict[str, str]:
    """Environment for Ray workers that run verl on CPU (pass as `worker_env` / `runtime_env["env_vars"]`)."""
    return {
        "VERL_PLATFORM": PLATFORM_NAME,
        "VERL_ENGINE_DEVICE": "cuda",
        "VERL_USE_EXTERNAL_MODULES": __name__,
    }


def use_in_this_process() -> None:
    """Select the CPU platform in the calling process (the driver). Harmless when already selected; a process that
    already resolved another platform is switched, with verl's warning."""
    current = platform_manager._current_platform
    if not isinstance(current, PlatformCPU):
        platform_manager.set_platform(PlatformCPU())
