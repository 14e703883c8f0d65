"""Run a function right after a module is imported (`when_imported`), without importing it early.

kvtier's verl plugins (`kvtier.rollout.verl_plugin`: the learner-replay engine; on CPU
`kvtier.rollout.cpu.verl_platform`, `kvtier.rollout.cpu.rl_smoke_hooks`) are imported by verl's
`__init__` in every process (`VERL_USE_EXTERNAL_MODULES`), before most of verl is loaded. Patching a verl
module then would mean importing it early (heavy, and for some modules too early: they read the platform at
import time); patching it when it is imported is exact: no caller can copy an unpatched name first.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from types import ModuleType
from typing import Callable

logger = logging.getLogger("kvtier.rollout")

Hook = Callable[[ModuleType], None]
_HOOKS: dict[str, list[Hook]] = {}


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for hook in _HOOKS.get(self.name, []):
            hook(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _PostImportLoader):
                    spec.loader = _PostImportLoader(spec.loader, fullname)
                return spec
        return None


def _finder_installed() -> bool:
    return any(isinstance(f, _PostImportFinder) for f in sys.meta_path)


def when_imported(name: str, hook: Hook, ready: Callable[[ModuleType], bool] | None = None) -> None:
    """Call `hook(module)` once `name` is imported: now if it already is (and `ready(module)` says its import
    has finished, when given), else right after its import."""
    if not _finder_installed():
        sys.meta_path.insert(0, _PostImportFinder())
    module = sys.modules.get(name)
    if module is not None and (ready is None or ready(module)):
        hook(module)
        return
    if module is not None:
        logger.warning("kvtier: %s is being imported while its hook is registered; %s not applied", name,
                       getattr(hook, "__name__", hook))
        return
    _HOOKS.setdefault(name, []).append(hook)
