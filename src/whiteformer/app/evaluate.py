"""``whiteformer eval`` and ``whiteformer generate``: load a trained model and measure or sample.

A checkpoint argument may be a run directory (its ``final_ema/`` or ``final/``, else its newest
valid checkpoint), a model directory written by ``save_pretrained`` (``final/``,
``checkpoints/step_*``), or a foreign weights file (with ``model=NAME``). A run's dataset settings
(``train_config.json`` next to the weights) are the defaults of ``eval``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ..models.factory import RUN_MODEL_DIR, resolve_model_dir
from ..models.read import read_json
from .config import ConfigError, EvalConfig, GenerateConfig
from .train.build import build_task, check_names
from .train.checkpoint import latest_checkpoint, verify_checkpoint
from .train.distributed import DistInfo, resolve_device
from .train.loop import nonfinite_weight

__all__ = ["resolve_checkpoint", "load_model", "evaluate", "generate"]


def resolve_checkpoint(path, prefer_ema: bool = True) -> Tuple[Path, Optional[Dict[str, Any]]]:
    """(model directory or file, the run's training configuration or None)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        try:
            p = resolve_model_dir(p, prefer_ema=prefer_ema)
        except FileNotFoundError as err:
            found = latest_checkpoint(p / "checkpoints", loader=verify_checkpoint)
            if found is None and "--overwrite" in str(err):  # the replaced run is hidden: named
                raise ConfigError(str(err)) from None
            if found is None:
                raise ConfigError(f"{str(path)!r} holds no model: expected a run directory ({RUN_MODEL_DIR}/ or "
                                  f"checkpoints/) or a directory with config.json + model.safetensors") from None
            p = found[0]
    elif p.is_dir() and (p / "manifest.json").is_file():
        verify_checkpoint(p)  # a training checkpoint: refuse a corrupt one clearly
    run_cfg = None
    folder = p if p.is_dir() else p.parent  # a weights file: the run's settings beside it (final/model.safetensors)
    if (folder / "train_config.json").is_file():
        run_cfg = read_json(folder / "train_config.json", dict)
    return p, run_cfg


def load_model(path: Path, model: Optional[str] = None, model_args: Optional[Dict[str, Any]] = None) -> nn.Module:
    from ..models import create_model, from_pretrained
    from ..models.read import read_config

    try:
        if model is None and path.is_file() and path.name == "model.safetensors" \
                and read_config(path.parent) is not None:
            path = path.parent  # the weights of a model folder: the folder, with its config.json
        if path.is_dir() and read_config(path) is not None and model is None:
            return from_pretrained(path, **(model_args or {}))
        if model is None:
            raise ConfigError(f"{str(path)!r} is not a whiteformer model directory; pass --model NAME to load it")
        check_names(model, None)
        return create_model(model, checkpoint_path=str(path), **(model_args or {}))
    except (ValueError, TypeError, FileNotFoundError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"cannot load {str(path)!r}: {err}") from err


def evaluate(cfg: EvalConfig) -> Dict[str, Any]:
    """Loss and accuracy (or perplexity) of a checkpoint on ``cfg.split`` of a dataset."""
    cfg.validate()
    path, run = resolve_checkpoint(cfg.checkpoint, prefer_ema=cfg.ema)
    run = run or {}
    dataset = cfg.dataset or run.get("dataset")
    if dataset is None:
        raise ConfigError("give --dataset (the checkpoint does not record the one it was trained on)")
    same = dataset == run.get("dataset")
    data_dir = cfg.data_dir if cfg.data_dir is not None else (run.get("data_dir") if same else None)
    data_args = {**(run.get("data_args", {}) if same else {}), **cfg.data_args}
    folder = path if path.is_dir() else path.parent
    if "train_tokenizer" in data_args and "train_tokenizer" not in cfg.data_args \
            and (folder / "tokenizer.json").is_file():
        # the tokenizer the model was trained with, not one trained again (on perhaps another file)
        data_args = {**{k: v for k, v in data_args.items() if k != "train_tokenizer"},
                     "tokenizer": str(folder / "tokenizer.json")}
    device = resolve_device(cfg.device)
    model = load_model(path, cfg.model, cfg.model_args).to(device).eval()
    task = build_task(dataset, data_dir=data_dir, data_args=data_args, eval_split=cfg.split, eval_only=True,
                      dist=DistInfo(device=device), batch_size=cfg.batch_size, eval_batch_size=cfg.batch_size,
                      block_size=cfg.block_size or run.get("block_size") or 128, eval_batches=cfg.eval_batches)
    type(task).check_model(model, task.eval_ds)
    bad = nonfinite_weight(model)
    if bad is not None:
        raise ConfigError(f"model {str(path)!r} cannot be evaluated: its weight {bad} holds NaN or inf")
    res = task.evaluate(model)
    if not math.isfinite(res.get("loss", 0.0)):
        raise ConfigError(f"model {str(path)!r} gives non-finite outputs on {dataset} (loss {res['loss']}): its "
                          f"weights overflow (values too large for {next(model.parameters()).dtype})")
    return {"checkpoint": str(path), "dataset": dataset, "split": cfg.split, "summary": task.summary(res),
            **res}


def _run_vocabulary(path):
    """(vocabulary, the file it came from) of a language model folder: the character ``vocab.json``,
    else the ``tokenizer.json`` a subword run saved."""
    from .data.text import CharVocab
    from .data.tokenizer import load_tokenizer

    vocab_file = path / "vocab.json" if path.is_dir() else None
    tok_file = path / "tokenizer.json" if path.is_dir() else None
    if vocab_file is not None and vocab_file.is_file():
        try:
            return CharVocab.from_json(read_json(vocab_file)), vocab_file
        except ValueError as err:  # not JSON (the message names the file), or not a character vocabulary
            raise ConfigError(str(err) if str(vocab_file) in str(err) else f"{str(vocab_file)!r}: {err}") from None
    if tok_file is not None and tok_file.is_file():
        try:
            return load_tokenizer(tok_file), tok_file
        except ValueError as err:
            raise ConfigError(str(err)) from None
    raise ConfigError(f"{str(path)!r} has no vocab.json or tokenizer.json: generate needs a language model trained "
                      f"by `whiteformer train --dataset text`")


@torch.no_grad()
def generate(cfg: GenerateConfig) -> list:
    """Samples (prompt + continuation) from a language model trained on text (characters or a tokenizer)."""
    cfg.validate()
    path, _ = resolve_checkpoint(cfg.checkpoint)
    vocab, vocab_file = _run_vocabulary(path)
    device = resolve_device(cfg.device)
    model = load_model(path).to(device).eval()
    if not hasattr(model, "generate"):
        raise ConfigError(f"{type(model).__name__} is not a language model (no generate())")
    size = getattr(model, "vocab_size", None) or getattr(model, "init_kwargs", {}).get("vocab_size")
    if isinstance(size, int) and len(vocab) < size:
        raise ConfigError(f"{str(vocab_file)!r} holds {len(vocab)} tokens, fewer than the model's vocabulary of "
                          f"{size}: it is not this model's vocabulary")
    try:
        idx = vocab.encode(cfg.prompt or "\n")
        if idx.numel() == 0:
            raise ValueError("it encodes to no token")
    except ValueError as err:
        raise ConfigError(f"prompt: {err}") from err
    idx = idx.unsqueeze(0).repeat(cfg.num_samples, 1).to(device)
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    try:
        out = model.generate(idx, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k or None,
                             generator=g)
    except ValueError as err:  # e.g. past the context limit of a model with position embeddings
        raise ConfigError(f"generate: {err}") from err
    return [vocab.decode(row.cpu()) for row in out]

