"""Import-only stand-in for torchvision in the SGLang server on CPU (see sglang_cpu_shims/__init__.py)."""

from _fully_async_placeholder import install, module_getattr

__version__ = "0.0.0+fully_async.shim"
__path__ = []  # submodules come from the placeholder finder
install(__name__)
__getattr__ = module_getattr(__name__)
