"""Loading a checkpoint into a built model: foreign key layouts converted, then a strict fit.

:func:`load_checkpoint` reads the state dict (:func:`whiteformer.models.read.read_state_dict`: an
own folder, a ``.safetensors`` file or a torch file), passes it through the model's
``convert_state_dict(state_dict)``, which maps foreign key layouts (official ToST, nanoGPT, timm, ...)
to its own (the identity on its own layout), and loads the result strictly: missing, unexpected or
shape-mismatched keys raise a ``ValueError`` that lists them, and a tensor of another kind than the
model's (integers where it has floats) is refused rather than cast.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.nn as nn

from .._files import check_path
from .read import PathLike, _open_safetensors, read_aliases, read_state_dict

__all__ = ["check_file_dtypes", "load_checkpoint"]


def _check_aliases_tied(model: nn.Module, aliases: Mapping[str, str], path) -> None:
    """Every alias of the file must be a tensor the model ties to its target (same storage)."""
    own = model.state_dict(keep_vars=True)
    for alias, key in aliases.items():
        a, b = own.get(alias), own.get(key)
        tied = (a is not None and b is not None and a.shape == b.shape
                and (a.device.type == "meta" or a.data_ptr() == b.data_ptr()))
        if not tied:
            raise ValueError(f"checkpoint {str(path)!r} stores {alias!r} as a copy of {key!r}, but "
                             f"{type(model).__name__} does not tie these two tensors; refusing the alias "
                             "(the file's metadata does not match this model)")


def _fmt(keys: List[str], limit: int = 5) -> str:
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _compare_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Dict[str, list]:
    """Compare keys and shapes with ``model.state_dict()``: ``{"missing", "unexpected", "mismatched"}``
    (``mismatched`` entries are ``(key, checkpoint_shape, model_shape)``)."""
    own = model.state_dict()
    missing = sorted(k for k in own if k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in own)
    mismatched = sorted(
        (k, tuple(state_dict[k].shape), tuple(own[k].shape))
        for k in own
        if k in state_dict and tuple(state_dict[k].shape) != tuple(own[k].shape)
    )
    return {"missing": missing, "unexpected": unexpected, "mismatched": mismatched}


def _dtype_kind(dtype) -> str:
    """floating-point / integer / bool / complex, of a torch dtype or a safetensors dtype name."""
    if isinstance(dtype, str):  # safetensors' header: F32, BF16, F8_E4M3, I64, U8, BOOL, C64, ...
        return ("bool" if dtype == "BOOL" else "complex" if dtype.startswith("C")
                else "floating-point" if dtype.startswith(("F", "BF")) else "integer")
    return ("bool" if dtype == torch.bool else "complex" if dtype.is_complex
            else "floating-point" if dtype.is_floating_point else "integer")


def _check_dtype_kinds(model: nn.Module, dtypes: Mapping[str, Any], path) -> None:
    """A tensor of the checkpoint (``dtypes``: key -> its tensor or its dtype) must be of the same
    kind as the model's (floating point, integer, bool, complex): ``load_state_dict`` (and
    ``transformers``' loader) would cast int64 weights to float, or floats to integer buffers, silently."""
    own = model.state_dict()
    for key, value in dtypes.items():
        dtype = value.dtype if isinstance(value, torch.Tensor) else value
        if key in own and _dtype_kind(dtype) != _dtype_kind(own[key].dtype):
            raise ValueError(f"checkpoint {str(path)!r}: {key!r} holds {_dtype_kind(dtype)} values "
                             f"({dtype}) where the model has {own[key].dtype}; refusing to cast them "
                             "(a corrupted file, or the checkpoint of another model)")


def check_file_dtypes(model: nn.Module, directory: PathLike) -> None:
    """:func:`_check_dtype_kinds` for the ``*.safetensors`` files of a local model directory,
    read from their headers (for loaders that cast on their own, e.g. ``transformers``)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for file in sorted(directory.glob("*.safetensors")):
        with _open_safetensors(file) as f:
            _check_dtype_kinds(model, {k: f.get_slice(k).get_dtype() for k in f.keys()}, file)


def load_checkpoint(model: nn.Module, path: PathLike, strict: bool = True,
                    reset_prefix: Optional[str] = None) -> Dict[str, list]:
    """Load a checkpoint into ``model`` (in place), converting foreign key layouts.

    ``strict=True`` raises a ``ValueError`` listing the missing / unexpected / shape-mismatched
    keys; ``strict=False`` loads the keys that fit (e.g. a backbone without its head) and returns
    the report ``{"missing", "unexpected", "mismatched"}``. ``reset_prefix`` (e.g. ``"head"``): when
    the checkpoint's tensors under that module do not fit the model's (another number of classes),
    they are skipped and the model keeps its fresh ones (timm's head reset); the report lists them
    under ``"reset"``.
    """
    sd = read_state_dict(check_path(path, "path"))
    _check_aliases_tied(model, read_aliases(path), path)
    convert = getattr(model, "convert_state_dict", None)
    if callable(convert):
        sd = convert(dict(sd))
    reset: List[str] = []
    if reset_prefix:
        under = lambda k: k == reset_prefix or k.startswith(reset_prefix + ".")  # noqa: E731
        first = _compare_state_dict(model, sd)
        if any(under(k) for k, _, _ in first["mismatched"]):
            reset = sorted(k for k in set(sd) | set(model.state_dict()) if under(k))
            sd = {k: v for k, v in sd.items() if not under(k)}
            sd.update({k: v for k, v in model.state_dict().items() if under(k)})
    _check_dtype_kinds(model, sd, path)
    report = _compare_state_dict(model, sd)
    if any(report.values()):
        if strict:
            parts = []
            if report["missing"]:
                parts.append(f"missing keys ({len(report['missing'])}): {_fmt(report['missing'])}")
            if report["unexpected"]:
                parts.append(f"unexpected keys ({len(report['unexpected'])}): {_fmt(report['unexpected'])}")
            if report["mismatched"]:
                mm = [f"{k} {tuple(a)} vs model {tuple(b)}" for k, a, b in report["mismatched"]]
                parts.append(f"mismatched shapes ({len(mm)}): {_fmt(mm)}")
            raise ValueError(f"checkpoint {str(path)!r} does not fit {type(model).__name__}: " + "; ".join(parts))
        bad = {k for k, _, _ in report["mismatched"]} | set(report["unexpected"])
        sd = {k: v for k, v in sd.items() if k not in bad}
    model.load_state_dict(sd, strict=strict)
    if reset:
        report["reset"] = reset
    return report
