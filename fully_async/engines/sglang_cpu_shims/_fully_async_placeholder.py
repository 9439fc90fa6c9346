"""Import-only placeholders for the SGLang CPU shims (see __init__.py): any attribute or submodule of a shimmed
package exists, so `from pkg.sub import Name` at import time succeeds, and using one raises NotImplementedError."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(
            f"{cls.__qualname__} is an import-only placeholder of fully_async's SGLang CPU shims; the text path "
            "never calls it"
        )


def placeholder(qualname: str) -> type:
    """A class that stands for any object (function, class, enum) named qualname: attributes are placeholders too,
    calling or instantiating it raises NotImplementedError."""
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


def module_getattr(module_name: str):
    """A module-level __getattr__ (PEP 562) answering every public name with a placeholder."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{module_name}.{name}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every submodule of the shimmed packages (torchvision.transforms.v2.functional, ...) as an empty
    package whose names are placeholders."""

    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in self.roots and "." in fullname:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


def install(root: str) -> None:
    """Serve the submodules of package `root` as placeholders."""
    for finder in sys.meta_path:
        if isinstance(finder, _Finder):
            finder.roots.add(root)
            return
    sys.meta_path.append(_Finder({root}))
