"""Fault-tolerant training checkpoints.

Layout of one checkpoint (a directory ``<run>/checkpoints/step_00001234/``)::

    model.safetensors    weights (own format: ``create_model(name, checkpoint_path=dir)`` loads it)
    config.json          model name and constructor arguments (``save_pretrained``)
    ema.safetensors      EMA weights (when the run keeps an EMA)
    trainer_state.pt     step, epoch, optimizer, scheduler and RNG states (``torch.load(weights_only)``)
    manifest.json        size and sha256 of every file above; written last

Atomicity: everything is written into a hidden new directory beside ``step_...``, flushed to disk,
and only then put in its place in one atomic step (:func:`whiteformer._files.staged_folder`); a
process killed at any moment leaves either the previous set of checkpoints or the new complete one
(plus an ignored temporary directory that the next run removes). A
checkpoint whose files do not match its manifest (truncated, corrupted) raises
:class:`CheckpointError`, and :func:`latest_checkpoint` falls back to the previous one.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from ..._files import check_path, is_stage, staged_folder
from ..._nesting import parse_bounded
from .outputs import remove_entry

__all__ = ["CheckpointError", "save_checkpoint", "load_training_checkpoint", "verify_checkpoint", "list_checkpoints",
           "latest_checkpoint", "quarantine", "list_quarantined", "remove_stale_temporaries", "rng_state",
           "set_rng_state", "MANIFEST"]

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
EMA_WEIGHTS = "ema.safetensors"
FORMAT = "whiteformer-train-checkpoint-v1"
_PREFIX = "step_"
_CORRUPT = "corrupt-"
_MAX_MANIFEST_BYTES = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or corrupt."""


# ----------------------------------------------------------------------------- RNG
def rng_state() -> Dict[str, Any]:
    """The torch (CPU and CUDA), numpy and Python RNG states, as weights_only-loadable objects."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "python": _python_state_to_list(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(_python_state_from_list(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_state_to_list(st) -> list:
    version, internal, gauss = st
    return [version, list(internal), gauss]


def _python_state_from_list(lst) -> tuple:
    version, internal, gauss = lst
    return (version, tuple(internal), gauss)


# ----------------------------------------------------------------------------- files
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _step_of(path: Path) -> Optional[int]:
    name = path.name
    if not name.startswith(_PREFIX):
        return None
    try:
        return int(name[len(_PREFIX):])
    except ValueError:
        return None


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def list_checkpoints(root) -> List[Path]:
    """Checkpoint directories under ``root`` sorted by step (oldest first); not verified."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def _discard(path: Path) -> None:
    """Delete a directory this module wrote (a link there is unlinked, never followed); a failure is
    a warning, neither hidden nor fatal to the run."""
    try:
        remove_entry(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        warnings.warn(f"could not delete {str(path)!r}: {err}", RuntimeWarning, stacklevel=2)


def remove_stale_temporaries(root) -> None:
    """Delete temporary directories left by interrupted writes."""
    root = Path(root)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-") or p.name.startswith(".trash-") or is_stage(p.name, _PREFIX):
                _discard(p)


# ----------------------------------------------------------------------------- save
def save_checkpoint(root, step: int, model: nn.Module, trainer_state: Dict[str, Any],
                    ema_state: Optional[Dict[str, torch.Tensor]] = None, keep_last: int = 3,
                    extra_files: Optional[Dict[str, str]] = None) -> Path:
    """Write checkpoint ``step`` atomically under ``root``; keep the newest ``keep_last``."""
    from safetensors.torch import save_file

    from ...models.save import _dedup_state_dict, write_model_files

    root = Path(check_path(root, "root"))
    final = root / checkpoint_name(step)
    try:
        with staged_folder(final, keep=False) as tmp:
            write_model_files(model, tmp)
            if ema_state is not None:
                tensors, aliases = _dedup_state_dict(ema_state)
                save_file(tensors, str(tmp / EMA_WEIGHTS), metadata={"format": "pt",
                                                                     "whiteformer_aliases": json.dumps(aliases)})
            torch.save({**trainer_state, "step": step, "format": FORMAT}, str(tmp / TRAINER_STATE))
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
            files = sorted(p.name for p in tmp.iterdir() if p.is_file() and not p.name.startswith("."))
            manifest = {"format": FORMAT, "step": step,
                        "files": {n: {"size": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in files}}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")  # last
    except BaseException as err:
        if isinstance(err, (OSError, RuntimeError)) or type(err).__name__ == "SafetensorError":
            # Disk full, read-only, quota: the previous checkpoints are intact.
            raise CheckpointError(f"cannot write checkpoint {str(final)!r}: {err} (the previous checkpoints are "
                                  f"intact; free disk space and --resume)") from err
        raise
    for old in list_checkpoints(root)[:-keep_last]:
        _discard(old)
    return final


# ----------------------------------------------------------------------------- load
def verify_checkpoint(path) -> Dict[str, Any]:
    """Check a checkpoint directory against its manifest; returns the manifest.
    Raises :class:`CheckpointError` saying what is wrong."""
    path = Path(check_path(path, "path"))
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: no {MANIFEST}")
    if mpath.stat().st_size > _MAX_MANIFEST_BYTES:
        raise CheckpointError(f"checkpoint {str(path)!r}: its {MANIFEST} has {mpath.stat().st_size} bytes, more than "
                              f"a manifest of a few files ever holds ({_MAX_MANIFEST_BYTES}); not a whiteformer "
                              f"checkpoint")
    try:
        manifest = parse_bounded(lambda: json.loads(mpath.read_text(encoding="utf-8")))
    except ValueError as err:  # not JSON, not UTF-8, nested too deeply
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable {MANIFEST} ({err})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} must map each file name to its size and "
                              f"sha256 under 'files' (found {type(files).__name__})")
    # Only the checkpoint's own regular files (links are not followed), each named once and plainly.
    present = {e.name for e in os.scandir(path) if e.is_file(follow_symlinks=False)}
    if len(files) > len(present):
        raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} lists {len(files)} files, more than the "
                              f"{len(present)} the checkpoint holds")
    for name, meta in files.items():
        if name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
            raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} names {name[:100]!r}, not a file of the "
                                  f"checkpoint directory itself")
        if not (isinstance(meta, dict) and type(meta.get("size")) is int and isinstance(meta.get("sha256"), str)):
            raise CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST} gives no size and sha256 for {name!r}")
        if name not in present:
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
        size = (path / name).stat().st_size
        if size != meta["size"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is truncated or corrupt: {name} has {size} bytes, "
                                  f"expected {meta['size']}")
    for name, meta in files.items():  # sizes all checked before any hashing
        if _sha256(path / name) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: the sha256 of {name} does not match "
                                  f"its manifest")
    for required in ("model.safetensors", TRAINER_STATE):
        if required not in files:
            raise CheckpointError(f"checkpoint {str(path)!r} lists no {required}")
    return manifest


def load_training_checkpoint(path) -> Dict[str, Any]:
    """Verify and read a training checkpoint (weights and trainer state; the model loader is
    :func:`whiteformer.models.load.load_checkpoint`): ``{"model": state_dict, "trainer": dict, "ema": state_dict
    or None, "path": Path}`` (tensors on CPU)."""
    from ...models.read import _load_safetensors

    path = Path(path)
    verify_checkpoint(path)
    try:
        model_sd = _load_safetensors(path / "model.safetensors")
        ema_sd = _load_safetensors(path / EMA_WEIGHTS) if (path / EMA_WEIGHTS).is_file() else None
        trainer = torch.load(str(path / TRAINER_STATE), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any read failure means an unusable checkpoint
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {err}") from err
    if not isinstance(trainer, dict) or trainer.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: {TRAINER_STATE} is not a whiteformer trainer state")
    return {"model": model_sd, "trainer": trainer, "ema": ema_sd, "path": path}


def quarantine(path: Path) -> Path:
    """Rename a corrupt checkpoint ``step_N`` to ``corrupt-step_N[-k]`` beside it: kept for
    inspection, no longer a checkpoint (never resumed from, never counted by ``keep_last``)."""
    dest = path.with_name(f"{_CORRUPT}{path.name}")
    k = 1
    while dest.exists():
        dest = path.with_name(f"{_CORRUPT}{path.name}-{k}")
        k += 1
    os.rename(path, dest)
    return dest


def list_quarantined(root) -> List[str]:
    """Names of the checkpoints under ``root`` that :func:`quarantine` moved aside, sorted."""
    root = Path(root)
    return sorted(p.name for p in root.iterdir() if p.name.startswith(_CORRUPT)) if root.is_dir() else []


def latest_checkpoint(root, log: Callable[[str], None] = print,
                      loader: Callable[[Path], Any] = load_training_checkpoint,
                      quarantine_corrupt: bool = False) -> Optional[Tuple[Path, Any]]:
    """Newest checkpoint under ``root`` that loads; corrupt ones are reported through ``log`` and
    skipped (falling back to the previous one), and with ``quarantine_corrupt`` (the run's writer)
    renamed out of the way (:func:`quarantine`). ``None`` when there is none."""
    for path in reversed(list_checkpoints(root)):
        try:
            return path, loader(path)
        except CheckpointError as err:
            where = ""
            if quarantine_corrupt and path.exists():
                try:
                    where = f" (moved to {quarantine(path).name})"
                except OSError:
                    pass
            log(f"warning: {err}{where}; falling back to the previous checkpoint")
    return None
