"""Reading model files: a saved model folder's ``config.json`` and the state dict of any checkpoint.

Own format (a directory, written by :func:`whiteformer.models.save.save_pretrained`)::

    <dir>/model.safetensors   weights (tensors sharing storage, e.g. tied embeddings, stored once:
                              the metadata entry ``whiteformer_aliases`` maps each alias to its tensor)
    <dir>/config.json         the model's name, class and constructor arguments (see models.save)

Foreign checkpoints: a ``.pth``/``.pt``/``.bin``/``.ckpt`` file is read with
``torch.load(..., weights_only=True)`` (``argparse.Namespace`` entries, which the official ToST /
DeiT training scripts store under ``"args"``, are allowed), a ``"model"``/``"state_dict"`` entry is
unwrapped and ``module.``/``_orig_mod.`` prefixes are stripped (:func:`read_state_dict`). A file that
cannot be read is a :class:`CheckpointFileError` naming it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from .._nesting import NestingError, parse_bounded

__all__ = ["CheckpointFileError", "PathLike", "WEIGHTS_NAME", "CONFIG_NAME", "load_torch_file", "read_aliases",
           "read_config", "read_json", "read_state_dict"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: safetensors metadata entry of the tied tensors a file stores once ({alias: stored key}, JSON)
ALIAS_KEY = "whiteformer_aliases"
_TORCH_EXTS = (".pth", ".pt", ".bin", ".ckpt")
_PREFIXES = ("module.", "_orig_mod.")

PathLike = Union[str, os.PathLike]


class CheckpointFileError(ValueError):
    """A checkpoint or ``config.json`` that cannot be read: truncated, corrupt, or not in the
    format its name says; ``path`` names the file (the message does too)."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        super().__init__(f"{self.path!r} {problem}")



def read_json(path: PathLike, want: Optional[type] = None) -> Any:
    """The JSON value of a file written with a model (``config.json``, ``train_config.json``,
    ``vocab.json``); unparsable text (or, with ``want``, another kind of value) is a
    :class:`CheckpointFileError` naming the file (and the line and column)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = parse_bounded(lambda: json.load(f))
    except NestingError as err:
        raise CheckpointFileError(path, f"is not a valid file: its JSON {err}") from None
    except json.JSONDecodeError as err:
        raise CheckpointFileError(path, f"is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") \
            from None
    except UnicodeDecodeError as err:
        raise CheckpointFileError(path, f"is not a UTF-8 text file (JSON expected): {err.reason}") from None
    if want is not None and not isinstance(value, want):
        raise CheckpointFileError(path, f"must hold a JSON {'object' if want is dict else want.__name__}, got "
                                        f"{type(value).__name__}")
    return value


def read_config(path: PathLike) -> Optional[Dict[str, Any]]:
    """The ``config.json`` of an own-format directory (``None`` for a file or a dir without one)."""
    path = Path(path)
    cfg = path / CONFIG_NAME if path.is_dir() else None
    if cfg is None or not cfg.is_file():
        return None
    config = read_json(cfg)
    if not isinstance(config, dict) or not isinstance(config.get("init_kwargs", {}), dict):
        raise ValueError(f"{str(cfg)!r} is not a whiteformer config (expected an object with 'init_kwargs')")
    return config


def _aliases(meta: Mapping[str, str], keys, path) -> Dict[str, str]:
    """The validated ``{alias: stored key}`` map of a safetensors file's metadata."""
    raw = meta.get(ALIAS_KEY)
    if raw is None:
        return {}
    try:
        aliases = parse_bounded(lambda: json.loads(raw))
    except ValueError as err:
        raise ValueError(f"{str(path)!r}: metadata {ALIAS_KEY!r} is not valid JSON ({err})") from None
    if not isinstance(aliases, dict) or not all(isinstance(a, str) and isinstance(k, str)
                                                for a, k in aliases.items()):
        raise ValueError(f"{str(path)!r}: metadata {ALIAS_KEY!r} must map tensor names to tensor names")
    missing = sorted(k for k in aliases.values() if k not in keys)
    if missing:
        raise ValueError(f"{str(path)!r}: metadata {ALIAS_KEY!r} points to tensors the file does not hold: {missing}")
    return aliases


def read_aliases(path: PathLike) -> Dict[str, str]:
    """``{alias: stored key}`` of the tied tensors a safetensors file stores once ({} for others)."""
    path = Path(path)
    if path.is_dir():
        path = path / WEIGHTS_NAME
    if path.suffix != ".safetensors" or not path.is_file():
        return {}
    with _open_safetensors(path) as f:
        return _aliases(f.metadata() or {}, set(f.keys()), path)


@contextlib.contextmanager
def _open_safetensors(path: Path):
    """``safe_open(path)`` whose errors (a ``SafetensorError`` that names no file: truncated,
    corrupt header, ...) become a :class:`CheckpointFileError` naming ``path``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as err:
        raise CheckpointFileError(path, f"is not a readable safetensors file (truncated or corrupt?): {err}") \
            from None


def _load_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    """Tensors of a safetensors file, tied tensors stored once filled back from the alias metadata.
    An alias that names a tensor the file also stores must be equal to its target (else refused)."""
    out: Dict[str, torch.Tensor] = {}
    with _open_safetensors(path) as f:
        meta = f.metadata() or {}
        for k in f.keys():
            out[k] = f.get_tensor(k)
    for alias, key in _aliases(meta, out, path).items():
        if alias in out and not (out[alias].shape == out[key].shape and torch.equal(out[alias], out[key])):
            raise ValueError(f"{str(path)!r}: metadata says {alias!r} is a copy of {key!r}, but the file stores a "
                             "different tensor under that name; refusing to replace it")
        out[alias] = out[key]
    return out


#: words of torch's weights-only unpickler when a file holds objects it refuses (globals, classes);
#: any other unpickling failure means the bytes are not a pickle at all
_REFUSED_OBJECT = ("GLOBAL", "global", "allowlist", "Can only")


def load_torch_file(path: Path):
    """``torch.load(path, weights_only=True)`` (``argparse.Namespace`` allowed); a file that is not
    a torch checkpoint at all is a :class:`CheckpointFileError`, a pickle holding objects other
    than tensors stays torch's ``UnpicklingError`` (refused: such objects could run code)."""
    import pickle

    try:
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:  # retried once with argparse.Namespace allowed
            if "Namespace" not in str(err) or not hasattr(torch.serialization, "safe_globals"):
                raise
            with torch.serialization.safe_globals([argparse.Namespace]):
                return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if any(w in str(err) for w in _REFUSED_OBJECT):
            raise pickle.UnpicklingError(f"refused to load {str(path)!r}: it holds objects other than tensors, "
                                         f"which could run code ({_torch_problem(err)})") from err
        raise CheckpointFileError(path, f"is not a valid torch checkpoint (not a pickle of tensors: "
                                        f"{_torch_problem(err)})") from None
    except OSError:
        raise  # the file system's word (permission, missing file) names the file itself
    except Exception as err:  # noqa: BLE001 - garbage bytes fail anywhere in the unpickler / zip reader
        raise CheckpointFileError(path, f"is not a valid torch checkpoint (truncated or corrupt?): "
                                        f"{type(err).__name__}: {_torch_problem(err)}") from None


def _torch_problem(err: BaseException) -> str:
    """The telling line of torch.load's message (its weights-only failures start with a long preamble)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    telling = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Please file an issue",
                                                          "Check the documentation", "WeightsUnpickler error"))]
    return (telling or lines or [type(err).__name__])[0][:200]


def _strip_prefixes(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for p in _PREFIXES:
                if key.startswith(p):
                    key, changed = key[len(p):], True
        out[key] = value
    return out


def read_state_dict(path: PathLike) -> Dict[str, torch.Tensor]:
    """Raw state dict of a checkpoint (own dir / ``.safetensors`` / torch file), unwrapped and with
    the ``module.``/``_orig_mod.`` prefixes stripped, before any model-specific conversion."""
    path = Path(path)
    if path.is_dir():
        weights = path / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"checkpoint directory {str(path)!r} has no {WEIGHTS_NAME}")
        sd: Any = _load_safetensors(weights)
    elif not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    elif path.suffix == ".safetensors":
        sd = _load_safetensors(path)
    elif path.suffix in _TORCH_EXTS:
        sd = load_torch_file(path)
        for entry in ("model", "state_dict"):
            if isinstance(sd, Mapping) and isinstance(sd.get(entry), Mapping):
                sd = sd[entry]
                break
    else:
        raise ValueError(
            f"unsupported checkpoint {str(path)!r}: expected a directory saved by save_pretrained, a "
            f".safetensors file or a torch file ({', '.join(_TORCH_EXTS)})"
        )
    if not isinstance(sd, Mapping):
        raise ValueError(f"checkpoint {str(path)!r} does not hold a state dict (got {type(sd).__name__})")
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(
            f"checkpoint {str(path)!r}: entries {bad[:10]} are not tensors; expected a state dict "
            "(or a dict with a 'model' / 'state_dict' entry holding one)"
        )
    return _strip_prefixes(sd)
