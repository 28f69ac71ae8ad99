"""A stand-in for torchvision, for tests only (never shipped): sglang 0.5.23 imports it at
module level for multimodal models, and PyPI's torchvision builds do not load beside torch+cpu
(scripts/setup.sh removes them). Every name and submodule exists; using one raises."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvstore.test.stub"


class _Names(type):
    """Any attribute of a stand-in (``InterpolationMode.BICUBIC``) is another stand-in."""

    def __getattr__(cls, name: str) -> type:
        return _getattr(name)


class _Unavailable(metaclass=_Names):
    """Any torchvision name: a class to subclass or annotate with; calling it raises."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision is a test stub here (tests/sglang_hicache/shims)")

    def __class_getitem__(cls, item: object) -> type:
        return cls


def _getattr(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Unavailable,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _getattr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


__getattr__ = _getattr
sys.meta_path.append(_Finder())
