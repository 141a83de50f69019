"""Run a callback once a module has finished importing, without importing it ourselves.

Used by the bootstrap so that a job pays for moedoctor's recorder only when it imports torch.
No torch here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable

_callbacks: dict[str, list[Callable]] = {}


def when_imported(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` right after ``name`` is imported (at once if it already is)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        callback(module)
        return
    _callbacks.setdefault(name, []).append(callback)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _NotifyingLoader(spec.loader, fullname)
                return spec
        return None


class _NotifyingLoader(importlib.abc.Loader):
    def __init__(self, loader, fullname: str):
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for callback in _callbacks.pop(self._fullname, []):
            callback(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)
