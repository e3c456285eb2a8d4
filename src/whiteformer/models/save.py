"""Saving a model of the zoo as a folder that whiteformer, timm and transformers load.

::

    <dir>/model.safetensors   weights (tensors sharing storage, e.g. tied embeddings, stored once)
    <dir>/config.json         {"format", "model_name", "model_class", "init_kwargs", "version",
                               "model_type" (the family's name in transformers, see whiteformer.hf),
                               "auto_map" (transformers' remote-code entry, see models.formats.remote_code),
                               timm's fields: "architecture" (the model name), "num_classes",
                               "model_args" (= init_kwargs), "pretrained_cfg"}
    <dir>/whiteformer_auto.py the module auto_map names (imports whiteformer.hf; models.formats.remote_code)
    <dir>/README.md           the model card (models.model_card; a README.md of the user's is kept)

written by ``model.save_pretrained(dir)`` as one unit: the files go into a new folder beside
``dir`` that then takes its place in one atomic step (:func:`whiteformer._files.staged_folder`), so a
reader never sees the new config with the old weights, and a failed or killed save (a full disk)
leaves the model already there as it was; the folder's other files are kept.
``create_model(name, checkpoint_path=dir)`` uses the saved ``init_kwargs`` as defaults under the
caller's overrides, so a small variant loads back with one call; :func:`whiteformer.from_pretrained`
does the same from the saved ``model_name``.

Protocol for model classes: inherit :class:`PretrainedMixin` (before ``nn.Module``); the
constructor arguments are recorded automatically in ``self.init_kwargs`` (they must be JSON-able to
be saved: tuples come back as lists); override ``convert_state_dict`` to accept foreign layouts
(:func:`whiteformer.models.load.load_checkpoint` calls it).
"""
from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from .._files import check_path, replace_folder
from .._utils import to_jsonable
from .formats.remote_code import REMOTE_CODE_NAME, auto_map, write_remote_code
from .model_card import CARD_MARK, CARD_NAME, model_card
from .read import ALIAS_KEY, CONFIG_NAME, WEIGHTS_NAME, PathLike

__all__ = ["PretrainedMixin", "save_pretrained", "write_model_files", "complete_hub_folder", "card_is_ours"]

FORMAT = "whiteformer-v1"


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


def count_values(model: nn.Module) -> int:
    """Number of values the model saves: its parameters (a tied one counted once) and persistent
    buffers. Sizes only, so sharded (DTensor) and meta tensors count as their full shape."""
    buffers = {id(b): b.numel() for m in model.modules() for name, b in m._buffers.items()
               if b is not None and name not in m._non_persistent_buffers_set}
    return sum(p.numel() for p in model.parameters()) + sum(buffers.values())


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
    save_dir = Path(check_path(save_dir, "save_dir"))
    if save_dir.exists() and not save_dir.is_dir():
        raise ValueError(f"save_dir {str(save_dir)!r} exists and is not a directory")
    _model_config(model)  # refused before anything is written
    ours = card_is_ours(save_dir / CARD_NAME)
    model_files = (WEIGHTS_NAME, CONFIG_NAME, REMOTE_CODE_NAME)  # a new save replaces them all; other files stay
    return replace_folder(save_dir, lambda folder: write_model_files(model, folder, card=ours),
                          keep=lambda name: name not in model_files and not (ours and name == CARD_NAME))


def card_is_ours(path: Path) -> bool:
    """Whether a save may write the model card at ``path``: there is none, or one written here
    (a user's README.md, or a link, is kept)."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return False
    if not path.exists():
        return True
    with open(path, encoding="utf-8", errors="replace") as f:
        return CARD_MARK in f.read(4096)


def _init_kwargs(model: nn.Module) -> Dict[str, Any]:
    init_kwargs = getattr(model, "init_kwargs", None)
    if init_kwargs is None:
        raise TypeError(f"{type(model).__name__} does not record init_kwargs; inherit PretrainedMixin")
    return to_jsonable(dict(init_kwargs), "init_kwargs")


def timm_fields(model: nn.Module) -> Dict[str, Any]:
    """timm's ``config.json`` fields (``timm.create_model("hf-hub:...")`` reads a Hub folder by them):
    ``architecture`` (the model name), ``model_args`` (the constructor arguments), ``num_classes``
    and ``pretrained_cfg`` where the model has them."""
    fields: Dict[str, Any] = {"architecture": getattr(model, "model_name", None) or type(model).__name__,
                              "model_args": _init_kwargs(model)}
    if isinstance(getattr(model, "num_classes", None), int):
        fields["num_classes"] = model.num_classes
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict):
        fields["pretrained_cfg"] = to_jsonable({k: v for k, v in cfg.items() if v is not None}, "pretrained_cfg")
    return fields


def _model_config(model: nn.Module) -> Dict[str, Any]:
    config = {
        "format": FORMAT,
        "model_name": getattr(model, "model_name", None),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "init_kwargs": _init_kwargs(model),
        **timm_fields(model),
    }
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
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt", ALIAS_KEY: json.dumps(aliases)})
    if config.get("auto_map"):
        write_remote_code(folder)
    if card:
        (folder / CARD_NAME).write_text(model_card(config, count_values(model), card_extra), encoding="utf-8")
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


def complete_hub_folder(model: nn.Module, folder: PathLike, card: bool = False) -> None:
    """Add to a folder that ``transformers``' ``save_pretrained`` wrote for ``model`` (a stage of
    :func:`whiteformer._files.staged_folder`) what timm's users and the Hub read: timm's fields in its
    ``config.json`` (:func:`timm_fields`; ``transformers`` ignores them on loading) and, with ``card``,
    the model card ``README.md``."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    config.update(timm_fields(model))
    if card:
        (folder / CARD_NAME).write_text(model_card(config, count_values(model)), encoding="utf-8")
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
