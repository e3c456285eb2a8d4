"""Lazy access to matplotlib (optional ``viz`` extra) for the analysis figures.

Figures are built with ``matplotlib.figure.Figure`` directly (Agg rendering on ``savefig``), so
pyplot's global state and the user's backend are never touched.
"""
from __future__ import annotations

from typing import Tuple

__all__ = ["VIZ_HINT", "require_matplotlib", "new_figure"]

VIZ_HINT = "pip install 'whiteformer[viz]'"


def require_matplotlib(what: str = "this figure"):
    """Import matplotlib or raise an ImportError naming the ``viz`` extra."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"{what} needs matplotlib, which is in the optional 'viz' extra: {VIZ_HINT} "
            f"(or pip install matplotlib)"
        ) from err
    return matplotlib


def new_figure(size_inches: Tuple[float, float], dpi: int, what: str = "this figure"):
    """A pyplot-free ``Figure`` of the given size; saved PNGs are ``size * dpi`` pixels."""
    require_matplotlib(what)
    from matplotlib.figure import Figure

    return Figure(figsize=size_inches, dpi=dpi)
