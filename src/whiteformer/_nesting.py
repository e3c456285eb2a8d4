"""Bounded nesting of values read from untrusted JSON and YAML (``config.json``, a safetensors file's
metadata, a checkpoint's ``manifest.json``, ``-c FILE``, ``data_args=[[...]]``): lists and mappings
nested deeper than :data:`MAX_NESTING` levels are a :class:`NestingError`, where the parsers (and
every later walk over the value) would otherwise end in a ``RecursionError``."""
from __future__ import annotations

from typing import Any, Callable, Dict, TypeVar

__all__ = ["MAX_NESTING", "NestingError", "check_nesting", "parse_bounded"]

#: the deepest nesting of lists / mappings accepted (a model or run configuration uses 3 or 4)
MAX_NESTING = 100

T = TypeVar("T")


class NestingError(ValueError):
    """A value nests lists or mappings more than :data:`MAX_NESTING` levels deep."""

    def __init__(self, limit: int = MAX_NESTING):
        super().__init__(f"nests lists or mappings more than {limit} levels deep")


def check_nesting(value: Any, limit: int = MAX_NESTING) -> None:
    """:class:`NestingError` when lists / tuples / dicts in ``value`` nest more than ``limit`` levels.
    Iterative, and a value shared in several places (YAML aliases) is walked once per depth."""
    seen: Dict[int, int] = {}
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if not isinstance(v, (dict, list, tuple)):
            continue
        if depth > limit:
            raise NestingError(limit)
        if seen.get(id(v), 0) >= depth:
            continue
        seen[id(v)] = depth
        todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


def parse_bounded(parse: Callable[[], T], limit: int = MAX_NESTING) -> T:
    """``parse()`` (a JSON or YAML parser call) whose value is checked by :func:`check_nesting`; a parser
    that runs out of recursion on a deeper text is the same :class:`NestingError`."""
    try:
        value = parse()
    except RecursionError:
        raise NestingError(limit) from None
    check_nesting(value, limit)
    return value
