"""The CPU platform as verl sees it, in a fresh interpreter (the platform choice is process-wide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_cpu_platform_is_selected_by_the_worker_environment():
    code = textwrap.dedent(
        """
        import os
        from fully_async.training.cpu_platform import worker_env
        os.environ.update(worker_env())
        from verl.utils import device
        print(device.get_device_name(), device.get_nccl_backend(), device.get_resource_name(),
              device.is_device_available(), device.get_torch_device().max_memory_allocated())
        import torch
        device.get_torch_device().set_rng_state(torch.get_rng_state())
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-5:] == ["cpu", "gloo", "CPU", "False", "0"]
