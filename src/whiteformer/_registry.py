"""One name registry for every extension point (attention layers, models, datasets, tasks, CLI
commands, kernel backends), in the manner of timm's ``_registry.py``.

A :class:`Registry` maps names to objects (classes, functions, records) with optional metadata::

    ATTENTION = Registry("attention")

    @ATTENTION.register("tssa")             # or ATTENTION.register("tssa", TSSA)
    class TSSA(nn.Module): ...

    ATTENTION.get("tsa")   # ValueError: unknown attention 'tsa' (did you mean 'tssa'?); expected one of: ...
    ATTENTION.list("t*")   # sorted names, optionally filtered by an fnmatch pattern
    ATTENTION.metadata("tssa")

It is a mutable mapping (``name in reg``, ``reg[name]``, ``dict(reg)``, ``reg.pop(name)``), so
code that reads a plain dict keeps working. Bottom of the package: imports nothing of it.
"""
from __future__ import annotations

import difflib
import fnmatch
from collections.abc import MutableMapping
from typing import Any, Dict, Iterable, Iterator, List, Optional

__all__ = ["Registry", "did_you_mean"]

_MISSING = object()


def did_you_mean(name: Any, choices: Iterable[str], n: int = 1) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to ``name`` (up to ``n``), or ``""``."""
    close = difflib.get_close_matches(str(name), list(choices), n=n)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


class Registry(MutableMapping):
    """Names -> objects of one ``kind`` (used in messages: "unknown {kind} 'x'").

    Args:
        kind: what the names name ("attention", "model", "dataset", ...).
        choices: how an unknown-name error lists the names; ``{names}`` (comma-separated, sorted)
            and ``{count}`` are filled in.
        replace: whether registering a taken name replaces its entry (kernel backends) instead of
            raising ``ValueError``.
    """

    def __init__(self, kind: str, *, choices: str = "expected one of: {names}", replace: bool = False):
        self.kind = kind
        self.choices = choices
        self.replace = replace
        self._entries: Dict[str, Any] = {}
        self._meta: Dict[str, Dict[str, Any]] = {}

    # ------------------------------------------------------------------ registering
    def register(self, name: str, obj: Any = _MISSING, /, **metadata: Any):
        """Register ``obj`` under ``name`` (with ``metadata``) and return it; without ``obj``, a
        decorator doing so. A name registered to another object raises ``ValueError`` (unless the
        registry replaces)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} name must be a non-empty str, got {name!r}")

        def add(value: Any) -> Any:
            old = self._entries.get(name, _MISSING)
            if old is not _MISSING and old is not value and not self.replace:
                owner = getattr(old, "__name__", type(old).__name__)
                raise ValueError(f"{self.kind} name {name!r} is already registered to {owner}")
            self._entries[name] = value
            self._meta[name] = dict(metadata)
            return value

        return add if obj is _MISSING else add(obj)

    # ------------------------------------------------------------------ looking up
    def hint(self, name: Any, n: int = 1) -> str:
        """``" (did you mean 'x'?)"`` for an unknown ``name``, or ``""``."""
        return did_you_mean(name, self._entries, n)

    def unknown(self, name: Any) -> str:
        """The message for an unknown ``name``: the closest name and the list of choices."""
        names = self.list()
        return (f"unknown {self.kind} {name!r}{self.hint(name)}; "
                + self.choices.format(names=", ".join(names), count=len(names)))

    def get(self, name: Any, default: Any = _MISSING) -> Any:
        """The object registered under ``name``; an unknown name returns ``default`` when given,
        else raises ``ValueError`` with :meth:`unknown`'s message."""
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        if default is not _MISSING:
            return default
        raise ValueError(self.unknown(name))

    def list(self, pattern: Optional[str] = None) -> List[str]:
        """Sorted names, optionally those matching the fnmatch ``pattern``."""
        names = sorted(self._entries)
        return [n for n in names if fnmatch.fnmatch(n, pattern)] if pattern else names

    def metadata(self, name: str) -> Dict[str, Any]:
        """The metadata given when ``name`` was registered (a copy)."""
        self.get(name)
        return dict(self._meta.get(name, {}))

    def copy(self) -> "Registry":
        """A registry with the same settings and entries (tests swap one in and out)."""
        new = Registry(self.kind, choices=self.choices, replace=self.replace)
        new._entries, new._meta = dict(self._entries), {k: dict(v) for k, v in self._meta.items()}
        return new

    # ------------------------------------------------------------------ mapping protocol
    def __getitem__(self, name: str) -> Any:
        return self._entries[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.register(name, value)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        self._meta.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self)} names)"

