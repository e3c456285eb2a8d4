"""Pretrained weights named by a model's ``pretrained_cfg``, found the way timm finds them.

``create_model(name, pretrained=True)`` merges the model's ``pretrained_cfg`` with the caller's
``pretrained_cfg`` and ``pretrained_cfg_overlay`` dicts (later ones win) and loads the first source
it names, in timm's order:

- ``file``: a local weights file or model folder (the ``model.safetensors`` / folder that
  ``save_pretrained`` writes, an official ToST ``.pth``, a timm state dict ...); a file with a model's
  ``config.json`` beside it loads with that config's sizes, the caller's arguments on top;
- ``hf_hub_id``: a Hugging Face Hub repository (``"org/name"``, ``"org/name@revision"``), fetched with
  ``huggingface_hub.hf_hub_download`` -- its cache (``HF_HUB_CACHE``) and offline mode
  (``HF_HUB_OFFLINE=1``) apply. ``model.safetensors`` is read, else ``pytorch_model.bin``
  (``hf_hub_filename`` names another file); with the repository's ``config.json`` the snapshot is a
  model folder (whiteformer's own, or a transformers ViT / DeiT one);
- ``url``: a file downloaded once into torch.hub's checkpoint cache (only the cached copy offline).

Foreign layouts go through the model's ``convert_state_dict`` (official ToST, timm DeiT) on the
way in, as for ``checkpoint_path``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional
from urllib.parse import urlparse

from .._checks import check_instance

__all__ = ["merge_pretrained_cfg", "pretrained_source", "NoPretrainedWeights"]

#: the keys of a pretrained_cfg that name where the weights are, in the order they are tried
SOURCE_KEYS = ("file", "hf_hub_id", "url")
HUB_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


class NoPretrainedWeights(ValueError):
    """The model's ``pretrained_cfg`` names no weights (none are published for it)."""


def merge_pretrained_cfg(base: Optional[Dict[str, Any]], pretrained_cfg: Any, overlay: Any) -> Dict[str, Any]:
    """``{**base, **pretrained_cfg, **overlay}``; the two caller arguments must be dicts (or None)."""
    for arg, value in (("pretrained_cfg", pretrained_cfg), ("pretrained_cfg_overlay", overlay)):
        check_instance(value, arg, dict, "a dict (e.g. dict(file='model.safetensors') or dict(hf_hub_id='org/name'))",
                       optional=True)
    return {**(base or {}), **(pretrained_cfg or {}), **(overlay or {})}


def _hub():
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401 - a lazy module: the offline flag is read from it
    except ImportError as err:
        raise ImportError("loading pretrained weights from the Hugging Face Hub needs huggingface_hub: "
                          "pip install 'whiteformer[hf]' (or pip install huggingface_hub); a local file loads "
                          "without it: pretrained_cfg_overlay=dict(file=PATH)") from err
    return huggingface_hub


def _from_hub(repo: str, filename: Optional[str]) -> Path:
    """The local path of the Hub repository's weights (its snapshot folder when it has a config.json)."""
    hub = _hub()
    from huggingface_hub.errors import EntryNotFoundError

    repo_id, _, revision = repo.partition("@")
    names = (filename,) if filename else HUB_WEIGHTS
    weights, first_err = None, None
    for name in names:
        try:
            weights = Path(hub.hf_hub_download(repo_id, name, revision=revision or None))
            break
        except EntryNotFoundError as err:  # offline and not cached, or not in the repository: try the next name
            first_err = first_err or err
    if weights is None:
        where = ("the Hugging Face cache (HF_HUB_OFFLINE is set: download it once online)"
                 if hub.constants.HF_HUB_OFFLINE else "the repository")
        raise FileNotFoundError(f"hf_hub_id {repo!r}: no {' or '.join(names)} in {where}: {first_err}") from first_err
    try:
        hub.hf_hub_download(repo_id, "config.json", revision=revision or None)
    except EntryNotFoundError:
        return weights
    # the snapshot folder is a model folder: its config.json gives the sizes (own or transformers' format)
    return weights.parent if weights.name == HUB_WEIGHTS[0] else weights


def _from_url(url: str) -> Path:
    """A file downloaded once into torch.hub's checkpoint cache (timm's ``load_state_dict_from_url``)."""
    import torch.hub

    name = os.path.basename(urlparse(url).path)
    if not name:
        raise ValueError(f"pretrained_cfg url {url!r} names no file")
    cached = Path(torch.hub.get_dir()) / "checkpoints" / name
    if cached.is_file():
        return cached
    if _hub().constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"pretrained_cfg url {url!r} is not in torch.hub's cache ({str(cached)!r}) and "
                                "HF_HUB_OFFLINE is set")
    cached.parent.mkdir(parents=True, exist_ok=True)
    torch.hub.download_url_to_file(url, str(cached), progress=True)
    return cached


def pretrained_source(name: str, cfg: Dict[str, Any]) -> Path:
    """The local file or folder holding the weights that ``cfg`` (a merged ``pretrained_cfg``) names
    for model ``name``; :class:`NoPretrainedWeights` when it names none."""
    for key in SOURCE_KEYS:
        value = cfg.get(key)
        if value in (None, ""):
            continue
        check_instance(value, f"pretrained_cfg[{key!r}]", (str, os.PathLike), "a str")
        if key == "file":
            path = Path(value).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"pretrained_cfg file {str(value)!r} does not exist")
            return path
        if key == "hf_hub_id":
            filename = cfg.get("hf_hub_filename")
            return _from_hub(str(value), str(filename) if filename else None)
        return _from_url(str(value))
    raise NoPretrainedWeights(
        f"no pretrained weights are published for {name!r} (its pretrained_cfg names no file, hf_hub_id or url); "
        f"load your own with create_model({name!r}, pretrained=True, pretrained_cfg_overlay=dict(file="
        f"'path/to/model.safetensors')), a Hub repository with pretrained_cfg_overlay=dict(hf_hub_id='org/name'), "
        f"or create_model({name!r}, checkpoint_path=...)")
