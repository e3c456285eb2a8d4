"""Run a function right after another library's module is imported (a post-import hook).

``import whiteformer`` uses it to register its models with ``transformers``' Auto classes and its
LoRA targets with ``peft`` *when those libraries are imported*, so importing whiteformer alone
imports neither (no start-up cost without them) and the registration does not depend on the order
of the imports::

    when_imported("peft.utils.constants", register_lora_targets)

If the module is already imported the function runs at once. A hook that fails warns (the
library's own import goes on).
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from typing import Callable, Dict, List

__all__ = ["when_imported"]

_HOOKS: Dict[str, List[Callable[[], None]]] = {}
_LOCK = threading.RLock()
_SEARCHING = threading.local()


def _run(name: str, hooks: List[Callable[[], None]]) -> None:
    for fn in hooks:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - never break the other library's import
            warnings.warn(f"whiteformer: registering with {name.split('.')[0]} failed: {err!r}", RuntimeWarning,
                          stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module, takes the spec the other finders give and wraps
    its loader's ``exec_module`` so that the hooks run once the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS or getattr(_SEARCHING, "name", None) == fullname:
            return None
        _SEARCHING.name = fullname
        spec = None
        try:  # the spec the other finders (path, editable installs, ...) give
            for finder in [f for f in sys.meta_path if f is not self]:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
        finally:
            _SEARCHING.name = None
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            with _LOCK:
                hooks = _HOOKS.pop(fullname, [])
            _run(fullname, hooks)

        loader.exec_module = exec_module
        return spec


_FINDER = _Finder()


def when_imported(name: str, fn: Callable[[], None]) -> None:
    """Call ``fn()`` once the module ``name`` (e.g. ``"transformers.models.auto.modeling_auto"``)
    has been imported: now if it already is, else right after its import (also when called while
    that module is still executing, if it was found through a hook registered before)."""
    with _LOCK:
        if name in sys.modules and name not in _HOOKS:  # (in both: executing under our loader, which runs _HOOKS)
            run_now = True
        else:
            run_now = False
            _HOOKS.setdefault(name, []).append(fn)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
    if run_now:
        _run(name, [fn])
