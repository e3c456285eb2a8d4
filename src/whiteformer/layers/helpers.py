"""Small argument helpers shared by the layers and models."""
from __future__ import annotations

from typing import Iterable, Sequence, Tuple, Union

from .._checks import is_int

__all__ = ["to_2tuple"]


def to_2tuple(v: Union[int, Sequence[int]], name: str = "value") -> Tuple[int, int]:
    """``v`` as an ``(h, w)`` pair of positive ints (an int is repeated)."""
    if is_int(v):
        v = (v, v)
    elif isinstance(v, Iterable) and not isinstance(v, (str, bytes)):
        v = tuple(v)
    if not isinstance(v, tuple) or len(v) != 2 or not all(is_int(a) for a in v):
        raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}")
    if min(v) <= 0:
        raise ValueError(f"{name} must be positive, got {v!r}")
    return v  # type: ignore[return-value]
