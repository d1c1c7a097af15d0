"""Run a function on a module once it is imported, without importing it: how the hooks reach a
class that only some processes load (vLLM's NIXL connector worker), in whichever process loads it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable
from types import ModuleType

log = logging.getLogger("engine_hooks")


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder ahead of the others for one module name: it finds the module's spec as the others
    would and wraps its loader's ``exec_module`` so that ``then(module)`` runs after it."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: and the finders below answer for the spec itself
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, then = loader.exec_module, self.then

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                then(module)
            except Exception as exc:  # tracing never stops the module from loading
                log.warning(
                    "engine_hooks: hooking %s failed (%s: %s); it is untraced", fullname, type(exc).__name__, exc
                )

        loader.exec_module = exec_module
        return spec


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` once module ``name`` is imported in this process: now, if it is already."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))
