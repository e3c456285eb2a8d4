"""Checkpoint saving and loading for every model of the zoo.

Own format (a directory)::

    <dir>/model.safetensors   weights (tensors sharing storage, e.g. tied embeddings, stored once)
    <dir>/config.json         {"format", "model_name", "model_class", "init_kwargs", "version",
                               "model_type" (the family's name in transformers, see whiteformer.hf),
                               "auto_map" (transformers' remote-code entry, see models.hf_remote),
                               timm's fields: "architecture" (the model name), "num_classes",
                               "model_args" (= init_kwargs), "pretrained_cfg"}
    <dir>/whiteformer_auto.py the module auto_map names (imports whiteformer.hf; models.hf_remote)
    <dir>/README.md           the model card (models.model_card; a README.md of the user's is kept)

written by ``model.save_pretrained(dir)`` as one unit: the files go into a new folder beside
``dir`` that then takes its place in one atomic step (:func:`whiteformer._files.staged_folder`), so a
reader never sees the new config with the old weights, and a failed or killed save (a full disk)
leaves the model already there as it was; the folder's other files are kept.
``create_model(name, checkpoint_path=dir)`` uses the saved ``init_kwargs`` as defaults under the
caller's overrides, so a small variant loads back with one call; :func:`whiteformer.from_pretrained`
does the same from the saved ``model_name``.

Foreign checkpoints (:func:`load_checkpoint`): a ``.pth``/``.pt``/``.bin``/``.ckpt`` file is read
with ``torch.load(..., weights_only=True)`` (``argparse.Namespace`` entries, which the official ToST
/ DeiT training scripts store under ``"args"``, are allowed), a ``"model"``/``"state_dict"`` entry is
unwrapped, ``module.``/``_orig_mod.`` prefixes are stripped, then the model's
``convert_state_dict(state_dict)`` maps foreign key layouts (official ToST, nanoGPT, timm, ...) to
its own (the identity on its own layout), and the result is loaded strictly: missing, unexpected or
shape-mismatched keys raise a ``ValueError`` that lists them.

Protocol for model classes: inherit :class:`PretrainedMixin` (before ``nn.Module``); the
constructor arguments are recorded automatically in ``self.init_kwargs`` (they must be JSON-able to
be saved: tuples come back as lists); override ``convert_state_dict`` to accept foreign layouts.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn as nn

from .._files import replace_folder
from .._nesting import NestingError, parse_bounded
from .._utils import to_jsonable
from .hf_remote import REMOTE_CODE_NAME, auto_map, write_remote_code
from .model_card import CARD_MARK, CARD_NAME, model_card

__all__ = [
    "CheckpointFileError",
    "check_file_dtypes",
    "PretrainedMixin",
    "load_checkpoint",
    "read_aliases",
    "read_config",
    "read_json",
    "read_state_dict",
    "save_pretrained",
    "write_model_files",
    "WEIGHTS_NAME",
    "CONFIG_NAME",
]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: the files of a model folder (a new save replaces them all; the folder's other files stay)
MODEL_FILES = (WEIGHTS_NAME, CONFIG_NAME, REMOTE_CODE_NAME)
FORMAT = "whiteformer-v1"
_TORCH_EXTS = (".pth", ".pt", ".bin", ".ckpt")
_ALIAS_KEY = "whiteformer_aliases"
_PREFIXES = ("module.", "_orig_mod.")

PathLike = Union[str, os.PathLike]


class CheckpointFileError(ValueError):
    """A checkpoint or ``config.json`` that cannot be read: truncated, corrupt, or not in the
    format its name says; ``path`` names the file (the message does too)."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        super().__init__(f"{self.path!r} {problem}")


# ----------------------------------------------------------------------------- init-kwargs capture
def _capture_init(init):
    """Wrap ``__init__`` so that the outermost call records its bound arguments in ``init_kwargs``."""
    sig = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        outer = not self.__dict__.get("_wf_in_init", False)
        if outer:
            object.__setattr__(self, "_wf_in_init", True)
        try:
            init(self, *args, **kwargs)
        finally:
            if outer:
                object.__delattr__(self, "_wf_in_init")
        if outer:
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            recorded: Dict[str, Any] = {}
            for name, value in list(bound.arguments.items())[1:]:
                kind = sig.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    recorded.update(value)
                elif kind is inspect.Parameter.VAR_POSITIONAL:
                    if value:
                        recorded[name] = list(value)
                else:
                    recorded[name] = value
            object.__setattr__(self, "init_kwargs", recorded)

    wrapper.__signature__ = sig  # keep the real signature visible to inspect (build_with_defaults)
    return wrapper


class PretrainedMixin:
    """Adds ``save_pretrained`` / ``convert_state_dict`` and records ``init_kwargs``.

    Attributes: ``init_kwargs`` (dict of the resolved constructor arguments, set automatically
    after ``__init__``), ``model_name`` (registry name, set by ``create_model``; ``None`` otherwise).
    """

    model_name: Optional[str] = None
    init_kwargs: Dict[str, Any]
    #: ``model_type`` of the model's family in ``transformers`` (:mod:`whiteformer.hf`), written
    #: into ``config.json`` so that ``AutoModel*.from_pretrained`` reads the directory.
    hf_model_type: Optional[str] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _capture_init(cls.__dict__["__init__"])

    def save_pretrained(self, save_dir: PathLike) -> Path:
        """Write ``model.safetensors`` + ``config.json`` into ``save_dir`` (created); returns it."""
        return save_pretrained(self, save_dir)

    def convert_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Map a foreign checkpoint's keys to this model's layout (identity by default)."""
        return state_dict


# ----------------------------------------------------------------------------- saving
def _dedup_state_dict(state_dict: Mapping[str, torch.Tensor]):
    """Tensors for safetensors (contiguous, CPU, no shared memory) and ``{alias: kept_key}``."""
    tensors: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    seen: Dict[tuple, str] = {}
    storages = set()
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict entry {key!r} is not a tensor ({type(t).__name__})")
        if t.device.type == "meta":
            raise ValueError(f"cannot save {key!r}: it is on the meta device (no data)")
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.numel() > 0 and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        out = t.detach().to("cpu").contiguous()
        if t.numel() > 0:
            ptr = (t.device, t.untyped_storage().data_ptr())
            if ptr in storages:
                out = out.clone()  # a different view of a storage another entry already uses
            storages.add(ptr)
        tensors[key] = out
    return tensors, aliases


def save_pretrained(model: nn.Module, save_dir: PathLike) -> Path:
    """Save ``model`` in the own format (see module docstring), replacing the model in ``save_dir`` as
    one unit and keeping the folder's other files. Returns the directory path."""
    save_dir = Path(save_dir)
    if save_dir.exists() and not save_dir.is_dir():
        raise ValueError(f"save_dir {str(save_dir)!r} exists and is not a directory")
    _model_config(model)  # refused before anything is written
    ours = _card_is_ours(save_dir / CARD_NAME)
    return replace_folder(save_dir, lambda folder: write_model_files(model, folder, card=ours),
                          keep=lambda name: name not in MODEL_FILES and not (ours and name == CARD_NAME))


def _card_is_ours(path: Path) -> bool:
    """Whether a save may write the model card at ``path``: there is none, or one written here
    (a user's README.md, or a link, is kept)."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return False
    if not path.exists():
        return True
    with open(path, encoding="utf-8", errors="replace") as f:
        return CARD_MARK in f.read(4096)


def _model_config(model: nn.Module) -> Dict[str, Any]:
    init_kwargs = getattr(model, "init_kwargs", None)
    if init_kwargs is None:
        raise TypeError(f"{type(model).__name__} does not record init_kwargs; inherit PretrainedMixin")
    name = getattr(model, "model_name", None)
    args = to_jsonable(dict(init_kwargs), "init_kwargs")
    config = {
        "format": FORMAT,
        "model_name": name,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "init_kwargs": args,
        # timm's fields (timm.create_model reads a Hub folder's config.json by them)
        "architecture": name or type(model).__name__,
        "model_args": args,
    }
    if isinstance(getattr(model, "num_classes", None), int):
        config["num_classes"] = model.num_classes
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict):
        config["pretrained_cfg"] = to_jsonable({k: v for k, v in cfg.items() if v is not None}, "pretrained_cfg")
    if getattr(model, "hf_model_type", None):
        config["model_type"] = model.hf_model_type
        config["auto_map"] = auto_map(model.hf_model_type)  # transformers loads the folder with trust_remote_code
    from .._version import __version__

    config["version"] = __version__
    return config


def write_model_files(model: nn.Module, folder: PathLike, card: bool = False, card_extra: str = "") -> Path:
    """Write the model's files into the new, private ``folder`` (a stage of
    :func:`whiteformer._files.staged_folder`, which makes them one unit): the weights, the code
    ``auto_map`` names, with ``card`` the model card ``README.md`` (``card_extra``: more of its
    markdown), then ``config.json``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    config = _model_config(model)
    tensors, aliases = _dedup_state_dict(model.state_dict())
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt", _ALIAS_KEY: json.dumps(aliases)})
    if config.get("auto_map"):
        write_remote_code(folder)
    if card:
        n = sum(t.numel() for t in tensors.values())
        (folder / CARD_NAME).write_text(model_card(config, n, card_extra), encoding="utf-8")
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------- reading
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
    raw = meta.get(_ALIAS_KEY)
    if raw is None:
        return {}
    try:
        aliases = parse_bounded(lambda: json.loads(raw))
    except ValueError as err:
        raise ValueError(f"{str(path)!r}: metadata {_ALIAS_KEY!r} is not valid JSON ({err})") from None
    if not isinstance(aliases, dict) or not all(isinstance(a, str) and isinstance(k, str)
                                                for a, k in aliases.items()):
        raise ValueError(f"{str(path)!r}: metadata {_ALIAS_KEY!r} must map tensor names to tensor names")
    missing = sorted(k for k in aliases.values() if k not in keys)
    if missing:
        raise ValueError(f"{str(path)!r}: metadata {_ALIAS_KEY!r} points to tensors the file does not hold: {missing}")
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


def _fmt(keys: List[str], limit: int = 5) -> str:
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def check_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Dict[str, list]:
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
    sd = read_state_dict(path)
    _check_aliases_tied(model, read_aliases(path), path)
    convert = getattr(model, "convert_state_dict", None)
    if callable(convert):
        sd = convert(dict(sd))
    reset: List[str] = []
    if reset_prefix:
        under = lambda k: k == reset_prefix or k.startswith(reset_prefix + ".")  # noqa: E731
        first = check_state_dict(model, sd)
        if any(under(k) for k, _, _ in first["mismatched"]):
            reset = sorted(k for k in set(sd) | set(model.state_dict()) if under(k))
            sd = {k: v for k, v in sd.items() if not under(k)}
            sd.update({k: v for k, v in model.state_dict().items() if under(k)})
    _check_dtype_kinds(model, sd, path)
    report = check_state_dict(model, sd)
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
