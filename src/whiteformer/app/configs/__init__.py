"""The shipped configurations of ``whiteformer train``, named by their file's stem.

``whiteformer train -c demo_digits`` reads ``demo_digits.yaml`` from this package wherever whiteformer
is installed (a path that exists is read as it is); ``whiteformer list-configs`` lists them with the
first sentence of each file's leading comment. A new config is one more YAML file here.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["list_configs", "shipped_config", "describe_config"]

_SUFFIX = ".yaml"


def _shipped() -> Dict[str, Path]:
    return {f.name[: -len(_SUFFIX)]: Path(str(f)) for f in resources.files(__name__).iterdir()
            if f.name.endswith(_SUFFIX)}


def list_configs() -> List[str]:
    """Sorted names of the shipped configs."""
    return sorted(_shipped())


def shipped_config(name: str) -> Optional[Path]:
    """The file of the shipped config ``name`` (``"demo_digits"`` or ``"demo_digits.yaml"``), or None."""
    return _shipped().get(name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name)


def describe_config(name: str) -> str:
    """The first sentence of the shipped config's leading ``#`` comment ('' without one)."""
    words = []
    with open(_shipped()[name], encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            words.append(line.lstrip("#").strip())
    text = " ".join(words)
    return text.split(". ", 1)[0].rstrip(".") + "." if text else ""
