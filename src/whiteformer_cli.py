"""The ``whiteformer`` console command's entry point, outside the package on purpose.

``import whiteformer`` loads the library (and torch, seconds of CPU): this module answers
``whiteformer --version`` without it, and turns an interrupt (Ctrl-C) while the library is still
being imported into the one line every other interrupt of the command gives. Everything else is
:func:`whiteformer.app.cli.main`.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Optional, Sequence

__all__ = ["main"]


def _version() -> str:
    """The package's ``__version__``, read from its ``_version.py`` without importing the package."""
    spec = importlib.util.find_spec("whiteformer")  # finds the package; runs none of it
    path = next(iter(spec.submodule_search_locations)) + "/_version.py"
    loader = importlib.util.spec_from_file_location("_whiteformer_version", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module.__version__


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``whiteformer ARGS``: the exit code of :func:`whiteformer.app.cli.main`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:
        print(f"whiteformer {_version()}")
        return 0
    try:
        from whiteformer.app.cli import main as run
    except KeyboardInterrupt:
        name = next((a for a in argv if a != "--debug"), "")
        print(f"whiteformer {name}".strip() + ": interrupted", file=sys.stderr)
        return 130
    return run(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
