"""``whiteformer compress``: compress a ViT / DeiT checkpoint's attention (IrrAtt paper) and save it.

    whiteformer compress --checkpoint CKPT --model deit_t_p16 --qk irratt --qk-flops-ratio 0.5 \\
        --vo-rank 32 [--mlp-rank R] [--calib 64 --dataset digits] [model_args.KEY=VALUE ...] \\
        [--finetune-epochs K --dataset digits|mnist --data-dir DIR [--fusion-constraints]] --out DIR

writes ``DIR/model.safetensors`` + ``DIR/config.json`` (``save_pretrained``; loads back with
``create_model(name, checkpoint_path=DIR)``), ``DIR/compression_report.json`` and
``DIR/compression_report.md`` (Table 1-style summary and per-block table). ``DIR`` must be missing or
empty unless ``--overwrite`` (which replaces only these files), and is never the checkpoint's own
directory, inside it, or a directory containing it: the source is never written to.

This module holds the command's options (:class:`CompressConfig`, read as every command's: defaults,
``-c FILE``, ``--key value`` / ``key=value``) and writes the files; data, evaluation and fine-tuning are
:mod:`whiteformer.app.finetune` (:func:`~whiteformer.app.finetune.build_image_task`,
:func:`~whiteformer.app.finetune.finetune_compressed`, with ``--fusion-constraints`` the
head-fusion projection of Sec. 3.3 as the post-step hook).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from .config import ConfigError, _h

__all__ = ["CompressConfig", "run"]


# ----------------------------------------------------------------------------- options
@dataclass
class CompressConfig:
    """``whiteformer compress``: compress a ViT/DeiT checkpoint's attention, optionally fine-tune, save + report.

    TruncAtt / CP SlimAtt / IrrAtt QK, VO TruncAtt, SVD MLP (paper 'Vision Transformer with Irregular
    Attention'); the compression options are those of :class:`~whiteformer.compress.CompressSpec`."""

    checkpoint: Optional[str] = _h("a run directory, its final/, a saved model directory (own or transformers "
                                   "ViT/DeiT), or a .safetensors/.pth file (required)", path=True, default=None)
    model: Optional[str] = _h("registered model name (default: the checkpoint's model_name; deit_b_p16 sized by its "
                              "config for a transformers ViT/DeiT directory)", default=None)
    model_args: Dict[str, Any] = _h("constructor overrides for create_model, e.g. model_args.drop_rate=0.0",
                                    default_factory=dict)
    qk: str = _h("QK compression: irratt, cp, truncatt or none", default="irratt")
    qk_rank: Optional[List[int]] = _h("truncatt: per-head rank (or H comma-separated); cp: R; irratt: total rank "
                                      "(or H ranks)", default=None)
    qk_flops_ratio: Optional[float] = _h("instead of --qk-rank: per block, the largest rank with QK MACs <= ratio x "
                                         "original (Sec. 3.4)", default=None)
    protocol: str = _h("how methods are compared at --qk-flops-ratio: flops (each method its largest rank within "
                       "the QK MACs budget) or rank (the paper's Table 1: every method TruncAtt's total rank H r)",
                       default="flops")
    vo: str = _h("VO compression: truncatt or none", default="truncatt")
    vo_rank: Optional[List[int]] = _h("VO TruncAtt rank per head, or H comma-separated (none: VO exact)", default=None)
    mlp_rank: Optional[List[int]] = _h("MLP SVD rank R or R1,R2 (none: MLP kept)", default=None)
    allow_growth: bool = _h("accept ranks that make an attention block or MLP cost more MACs than the original",
                            default=False)
    fusion: str = _h("IrrAtt head fusion: general or identity", default="general")
    rank_allocation: str = _h("IrrAtt per-head ranks: Algorithm 1 (btd) or global singular values (spectral)",
                              default="btd")
    blocks: Optional[List[int]] = _h("comma-separated block indices (none: all)", default=None)
    num_tokens: Optional[int] = _h("N for the budget (none: the model's tokens)", default=None)
    dataset: Optional[str] = _h("dataset for accuracy, calibration and fine-tuning (e.g. digits, mnist; default: "
                                "the run's when --checkpoint is a run directory)", default=None)
    data_dir: Optional[str] = _h("data directory of file-based datasets (mnist)", path=True, default=None)
    calib: int = _h("activation-aware compression on this many training images of --dataset (0: off)", default=0)
    finetune_epochs: int = _h("fine-tune this many epochs on --dataset", default=0)
    batch_size: int = _h("batch size of the evaluation, calibration and fine-tuning", default=64)
    lr: float = _h("fine-tuning learning rate", default=1e-4)
    weight_decay: float = _h("fine-tuning weight decay", default=0.05)
    max_steps: Optional[int] = _h("stop fine-tuning after this many steps", default=None)
    fusion_constraints: bool = _h("project head-fusion matrices onto {S >= 0, S S^T = I} after each fine-tuning "
                                  "step (Sec. 3.3)", default=False)
    latency_batch: Optional[int] = _h("measure latency before/after at this batch", default=None)
    latency_runs: int = _h("timed runs of each model (interleaved)", default=10)
    latency_threads: Optional[int] = _h("CPU threads while timing (none: torch's current count)", default=None)
    seed: int = _h("random seed (decompositions, calibration images, fine-tuning)", default=0)
    device: str = _h("cpu, cuda, cuda:N or auto", default="cpu")
    out: Optional[str] = _h("output directory (compressed checkpoint + report): missing or empty, never the "
                            "checkpoint's own directory or one that contains it (required)", path=True, default=None)
    overwrite: bool = _h("accept a non-empty --out: replace model.safetensors, config.json, whiteformer_auto.py and "
                         "compression_report.* there, keep the other files", default=False)
    quiet: bool = _h("no progress or summary lines", default=False)

    def validate(self) -> None:
        from .config import check_seed

        for flag in ("checkpoint", "out"):
            if getattr(self, flag) is None:
                raise ConfigError(f"compress needs --{flag} (see whiteformer compress --help)")
        for flag, v, low in (("--calib", self.calib, 0), ("--finetune-epochs", self.finetune_epochs, 0),
                             ("--batch-size", self.batch_size, 1), ("--latency-runs", self.latency_runs, 1),
                             ("--max-steps", self.max_steps, 1), ("--latency-batch", self.latency_batch, 1),
                             ("--latency-threads", self.latency_threads, 1), ("--num-tokens", self.num_tokens, 1)):
            if v is not None and v < low:
                raise ConfigError(f"{flag} must be >= {low}, got {v}")
        if self.max_steps is not None and not self.finetune_epochs:
            raise ConfigError("--max-steps limits fine-tuning: add --finetune-epochs K")
        for flag, v in (("--lr", self.lr), ("--weight-decay", self.weight_decay)):
            if not math.isfinite(v) or v < 0 or (flag == "--lr" and v == 0):
                raise ConfigError(f"{flag} must be a finite {'positive' if flag == '--lr' else 'non-negative'} "
                                  f"number, got {v}")
        if self.fusion_constraints and not self.finetune_epochs:
            raise ConfigError("--fusion-constraints applies to fine-tuning: add --finetune-epochs K")
        check_seed(self.seed, "--seed")
        self.spec()  # the compression options, checked before any work

    def spec(self):
        """The :class:`~whiteformer.compress.CompressSpec` of these options (a ``ConfigError`` for a bad one)."""
        from ..compress.spec import CompressSpec

        try:
            return CompressSpec(qk=self.qk, qk_rank=_ranks(self.qk_rank), qk_flops_ratio=self.qk_flops_ratio,
                                vo=self.vo, vo_rank=_ranks(self.vo_rank), mlp_rank=_ranks(self.mlp_rank),
                                fusion=self.fusion, rank_allocation=self.rank_allocation, protocol=self.protocol,
                                blocks=self.blocks, num_tokens=self.num_tokens, seed=self.seed,
                                latency_batch=self.latency_batch, latency_runs=self.latency_runs,
                                latency_threads=self.latency_threads, allow_growth=self.allow_growth,
                                progress=not self.quiet)
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None


def _ranks(values: Optional[List[int]]):
    """A rank option: one value as an int (a total or per-head rank), several as a tuple, none as None."""
    if values is None:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def check_out(out, checkpoint, model_path: Path, overwrite: bool) -> Path:
    """``--out`` if ``compress`` may write there: never the source model's directory, inside it, or a
    directory containing it (symbolic links resolved), and empty unless ``overwrite``."""
    from .config import ConfigError
    from .train.outputs import check_output_dir

    target = Path(out).expanduser().resolve()
    model_dir = model_path.resolve() if model_path.is_dir() else model_path.resolve().parent
    for src in (Path(checkpoint).expanduser().resolve(), model_path.resolve(), model_dir):
        how = ("is" if target == src else "contains" if target in src.parents
               else "is inside" if src == model_dir and model_dir in target.parents else None)
        if how is not None:
            raise ConfigError(f"--out {str(out)!r} {how} the checkpoint being compressed ({str(src)!r}); choose "
                              f"another --out (the source is never written to, even with --overwrite)")
    return check_output_dir(out, overwrite=overwrite)


def _sizes(model) -> str:
    """The model's real sizes, e.g. "D 64, 2 blocks, 4 heads, patch 8, 32 px"."""
    from ..models.formats.vit_weights import describe_sizes

    return describe_sizes(getattr(model, "init_kwargs", {}))


def _run(cfg: CompressConfig) -> int:
    import torch

    from ..compress.model import compress
    from ..models import create_model
    from ..models.read import read_config
    from ..models.save import write_model_files
    from .evaluate import resolve_checkpoint
    from .finetune import build_image_task, finetune_compressed
    from .train.distributed import resolve_device
    from .train.outputs import staged_output

    say = (lambda _m: None) if cfg.quiet else (lambda m: print(m, flush=True))
    ckpt, run = resolve_checkpoint(cfg.checkpoint, prefer_ema=True)  # run dir, final/ or a model dir/file
    check_out(cfg.out, cfg.checkpoint, ckpt, cfg.overwrite)  # before any work
    data, data_dir = cfg.dataset, cfg.data_dir
    if data is None and run:
        data, data_dir = run.get("dataset"), data_dir or run.get("data_dir")
    name = cfg.model
    if name is None:
        from ..models.formats.vit_weights import init_kwargs_from_config, is_hf_vit_config, model_name_for

        saved = read_config(ckpt)
        name = (saved or {}).get("model_name") or (model_name_for(init_kwargs_from_config(saved))
                                                   if is_hf_vit_config(saved) else None)
        if not name:
            raise ValueError(f"--checkpoint {cfg.checkpoint!r} does not name its model; pass --model NAME")
    if (cfg.calib or cfg.finetune_epochs) and not data:
        raise ValueError("--calib and --finetune-epochs need --dataset (e.g. --dataset digits)")
    spec = cfg.spec()
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model = create_model(name, checkpoint_path=str(ckpt), **cfg.model_args).to(device).eval()

    calib = task = None
    if data:
        task = build_image_task(model, data, data_dir, batch_size=cfg.batch_size, seed=cfg.seed, device=device)
        task.eval_progress = not cfg.quiet  # the accuracies before and after: a bar on a terminal
        if cfg.calib:
            n = min(cfg.calib, len(task.train_ds))
            idx = torch.randperm(len(task.train_ds), generator=torch.Generator().manual_seed(cfg.seed))[:n]
            calib = task.train_ds.get_batch(idx)[0].to(device)

    say(f"compressing {name} ({_sizes(model)}; {cfg.checkpoint}): qk={cfg.qk} "
        + (f"qk_rank={spec.qk_rank}" if spec.qk_rank is not None
           else f"qk_flops_ratio={spec.qk_flops_ratio} (protocol {spec.protocol})")
        + f", vo_rank={spec.vo_rank}, mlp_rank={spec.mlp_rank}" + (f", calib={len(calib)} images" if calib is not None
                                                                    else ""))
    t0 = time.perf_counter()
    new, report = compress(model, calib=calib, spec=spec)
    report.extra["compression_time_s"] = time.perf_counter() - t0
    if task is not None:
        report.extra["accuracy"] = {"original": task.evaluate(model)["acc"], "compressed": task.evaluate(new)["acc"]}
        say(f"{data} test accuracy: original {100 * report.extra['accuracy']['original']:.2f} %, compressed "
            f"{100 * report.extra['accuracy']['compressed']:.2f} %")
    if cfg.finetune_epochs:
        res = finetune_compressed(new, task, epochs=cfg.finetune_epochs, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fusion_constraints=cfg.fusion_constraints, max_steps=cfg.max_steps, log=say)
        report.extra["finetune"] = res
        report.extra["accuracy"]["finetuned"] = res["acc_after"]
    new.eval()
    out = check_out(cfg.out, cfg.checkpoint, ckpt, cfg.overwrite)
    md = report.to_markdown()
    with staged_output(out, overwrite=cfg.overwrite) as stage:  # moved into --out only once all is written
        write_model_files(new, stage)
        (stage / "compression_report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n",
                                                       encoding="utf-8")
        (stage / "compression_report.md").write_text(md, encoding="utf-8")
    say(md)
    lat = report.latency or {}
    if lat.get("speedup") is not None and lat["speedup"] < 1:
        say(f"note: the compressed model is slower than the original here (x{lat['speedup']:.2f} at batch "
            f"{lat.get('batch_size')}): fewer multiply-adds do not always mean less time")
    say(f"compressed checkpoint: {out} (load with create_model({name!r}, checkpoint_path={str(out)!r})); report: "
        f"{out / 'compression_report.md'}")
    return 0


def run(args: argparse.Namespace) -> int:
    """``whiteformer compress``: ``args`` parsed by :mod:`whiteformer.app.cli` (``-c FILE`` and
    ``args.overrides``, the options as in ``whiteformer train``). A bad value is a
    :class:`~whiteformer.app.config.ConfigError` (one ``error:`` line, exit code 2)."""
    from .config import config_from_args

    cfg = config_from_args(CompressConfig, args)
    try:
        return _run(cfg)
    except (ValueError, TypeError) as err:  # the compression's argument checks
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from err
