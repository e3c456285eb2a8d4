"""What a saved model folder carries so that ``transformers`` loads it without ``import whiteformer``.

Every ``config.json`` that whiteformer writes (its own ``save_pretrained`` and the
``transformers`` wrappers' one) names, under ``auto_map``, the classes of a small module saved next to
it, :data:`REMOTE_CODE_NAME`. That module only imports those classes from the installed whiteformer
package (:mod:`whiteformer.hf`) and says how to install it when it is missing, so::

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

works in a fresh process whose script never imports whiteformer. ``transformers`` copies the module
into its module cache (``HF_MODULES_CACHE``) and imports it from there.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Union

from ..._files import write_text

__all__ = ["REMOTE_CODE_NAME", "AUTO_CLASSES", "auto_map", "write_remote_code"]

REMOTE_CODE_NAME = "whiteformer_auto.py"
_MODULE = REMOTE_CODE_NAME[:-3]

#: ``model_type`` -> {transformers Auto class: whiteformer.hf class}
AUTO_CLASSES: Dict[str, Dict[str, str]] = {
    "whiteformer-tost-lm": {"AutoConfig": "ToSTLMConfig", "AutoModel": "ToSTModel",
                            "AutoModelForCausalLM": "ToSTForCausalLM"},
    "whiteformer-gpt": {"AutoConfig": "WhiteformerGPTConfig", "AutoModel": "WhiteformerGPTModel",
                        "AutoModelForCausalLM": "WhiteformerGPTForCausalLM"},
    "whiteformer-decoder": {"AutoConfig": "WhiteformerDecoderConfig", "AutoModel": "WhiteformerDecoderModel",
                            "AutoModelForCausalLM": "WhiteformerDecoderForCausalLM"},
    "whiteformer-vision": {"AutoConfig": "WhiteformerVisionConfig", "AutoModel": "WhiteformerVisionModel",
                           "AutoModelForImageClassification": "WhiteformerForImageClassification"},
}

_SOURCE = '''"""transformers entry point of a whiteformer model folder (written by whiteformer; see its
docs/transformers.md). The classes are whiteformer's own: this file runs
nothing else."""
try:
    from whiteformer.hf import (  # noqa: F401
{names}
    )
except ImportError as err:
    raise ImportError(
        "this model was saved by whiteformer: install it with its transformers extra "
        "(pip install 'whiteformer[hf]') to load it"
    ) from err
'''


def auto_map(model_type: str) -> Dict[str, str]:
    """The ``auto_map`` entry of a ``config.json`` of family ``model_type`` ({} for an unknown one)."""
    return {auto: f"{_MODULE}.{cls}" for auto, cls in AUTO_CLASSES.get(model_type, {}).items()}


def write_remote_code(save_dir: Union[str, os.PathLike]) -> Path:
    """Write :data:`REMOTE_CODE_NAME` into ``save_dir`` (the same file for every family)."""
    names = sorted({cls for classes in AUTO_CLASSES.values() for cls in classes.values()})
    path = Path(save_dir) / REMOTE_CODE_NAME
    text = _SOURCE.format(names="\n".join(f"        {n}," for n in names))
    if path.is_symlink() or not (path.is_file() and path.read_text(encoding="utf-8") == text):
        write_text(path, text)  # (a link in its place is replaced, never written through)
    return path
