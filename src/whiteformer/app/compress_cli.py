"""``whiteformer compress``: compress a ViT / DeiT checkpoint's attention (IrrAtt paper) and save it.

    whiteformer compress --checkpoint CKPT --model deit_t_p16 --qk irratt --qk-flops-ratio 0.5 \\
        --vo-rank 32 [--mlp-rank R] [--calib 64 --dataset digits] [model_args.KEY=VALUE ...] \\
        [--finetune-epochs K --dataset digits|mnist --data-dir DIR [--fusion-constraints]] --out DIR

writes ``DIR/model.safetensors`` + ``DIR/config.json`` (``save_pretrained``; loads back with
``create_model(name, checkpoint_path=DIR)``), ``DIR/compression_report.json`` and
``DIR/compression_report.md`` (Table 1-style summary and per-block table). ``DIR`` must be missing or
empty unless ``--overwrite`` (which replaces only these files), and is never the checkpoint's own
directory, inside it, or a directory containing it: the source is never written to.

This module holds the command's options (added to its subparser by :mod:`whiteformer.app.cli`) and
writes the files; data, evaluation and fine-tuning are
:mod:`whiteformer.app.finetune` (:func:`~whiteformer.app.finetune.build_image_task`,
:func:`~whiteformer.app.finetune.finetune_compressed`, with ``--fusion-constraints`` the
head-fusion projection of Sec. 3.3 as the post-step hook).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import List, Tuple

from .._nesting import NestingError, parse_bounded

__all__ = ["add_arguments", "run"]


# ----------------------------------------------------------------------------- command line
def _ranks(text: str):
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or comma-separated ints, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected an int or comma-separated ints, got {text!r}")
    return vals[0] if len(vals) == 1 else tuple(vals)


def _int_list(text: str) -> List[int]:
    r = _ranks(text)
    return [r] if isinstance(r, int) else list(r)


def _model_arg(text: str):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        val = parse_bounded(lambda: json.loads(v))
    except NestingError as err:
        raise argparse.ArgumentTypeError(f"the value of {k.strip()!r} {err}") from None
    except json.JSONDecodeError:
        val = v
    return k.strip(), val


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``whiteformer compress`` (``model_args.KEY=VALUE`` words are taken apart by
    :func:`run` from the words the parser does not know)."""
    from .config import path_argument

    p.description = ("Compress the attention of a ViT/DeiT checkpoint (TruncAtt / CP SlimAtt / IrrAtt QK, VO "
                     "TruncAtt, SVD MLP; paper 'Vision Transformer with Irregular Attention'), optionally fine-tune, "
                     "and save the compressed checkpoint with its report.")
    p.epilog = ("model_args.KEY=VALUE (repeatable, as in `whiteformer train`): a constructor override for "
                "create_model; VALUE is read as JSON where it parses, else kept as text.")
    p.add_argument("--checkpoint", required=True, type=path_argument,
                   help="a run directory, its final/, a saved model directory (own or transformers ViT/DeiT), or a "
                        ".safetensors/.pth file")
    p.add_argument("--model", default=None, help="registered model name (default: the checkpoint's model_name; "
                   "deit_b_p16 sized by its config for a transformers ViT/DeiT directory)")
    p.set_defaults(model_args=[])  # model_args.KEY=VALUE words, taken apart by main()
    p.add_argument("--qk", choices=["irratt", "cp", "truncatt", "none"], default="irratt", help="QK compression")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--qk-rank", type=_ranks, default=None,
                   help="truncatt: per-head rank (or H comma-separated); cp: R; irratt: total rank (or H ranks)")
    g.add_argument("--qk-flops-ratio", type=float, default=None,
                   help="per block, the largest rank with QK MACs <= ratio x original (Sec. 3.4)")
    p.add_argument("--protocol", choices=["flops", "rank"], default="flops",
                   help="how methods are compared at --qk-flops-ratio: flops (each method its largest rank within "
                        "the QK MACs budget) or rank (the paper's Table 1: every method TruncAtt's total rank H r)")
    p.add_argument("--vo", choices=["truncatt", "none"], default="truncatt", help="VO compression")
    p.add_argument("--vo-rank", type=_ranks, default=None, help="VO TruncAtt rank per head (default: VO exact)")
    p.add_argument("--mlp-rank", type=_ranks, default=None, help="MLP SVD rank R or R1,R2 (default: MLP kept)")
    p.add_argument("--allow-growth", action="store_true",
                   help="accept ranks that make an attention block or MLP cost more MACs than the original "
                        "(refused by default)")
    p.add_argument("--fusion", choices=["general", "identity"], default="general", help="IrrAtt head fusion")
    p.add_argument("--rank-allocation", choices=["btd", "spectral"], default="btd",
                   help="IrrAtt per-head ranks: Algorithm 1 (btd) or global singular values (spectral)")
    p.add_argument("--blocks", type=_int_list, default=None, help="comma-separated block indices (default all)")
    p.add_argument("--num-tokens", type=int, default=None, help="N for the budget (default: the model's tokens)")
    p.add_argument("--dataset", dest="data", default=None,
                   help="dataset for accuracy, calibration and fine-tuning (e.g. digits, mnist; default: the run's "
                        "when --checkpoint is a run directory)")
    p.add_argument("--data-dir", default=None, type=path_argument, help="data directory of file-based datasets (mnist)")
    p.add_argument("--calib", type=int, default=0, metavar="N",
                   help="activation-aware compression on N training images of --dataset (0: off)")
    p.add_argument("--finetune-epochs", type=int, default=0, metavar="K", help="fine-tune K epochs on --dataset")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=None, help="stop fine-tuning after this many steps")
    p.add_argument("--fusion-constraints", action="store_true",
                   help="project head-fusion matrices onto {S >= 0, S S^T = I} after each step (Sec. 3.3)")
    p.add_argument("--latency-batch", type=int, default=None, help="measure latency before/after at this batch")
    p.add_argument("--latency-runs", type=int, default=10, help="timed runs of each model (interleaved)")
    p.add_argument("--latency-threads", type=int, default=None,
                   help="CPU threads while timing (default: torch's current count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--out", required=True, type=path_argument, help="output directory (compressed checkpoint + report): missing or "
                   "empty, never the checkpoint's own directory or one that contains it")
    p.add_argument("--overwrite", action="store_true",
                   help="accept a non-empty --out: replace model.safetensors, config.json, whiteformer_auto.py and "
                        "compression_report.* there, keep the other files (the checkpoint's own directory is still refused)")
    p.add_argument("--quiet", action="store_true")


def _check_counts(args: argparse.Namespace) -> None:
    """The integer options' ranges and the seed (a ``ValueError`` naming the flag)."""
    from .config import check_seed

    for flag, v, low in (("--calib", args.calib, 0), ("--finetune-epochs", args.finetune_epochs, 0),
                         ("--batch-size", args.batch_size, 1), ("--latency-runs", args.latency_runs, 1),
                         ("--max-steps", args.max_steps, 1), ("--latency-batch", args.latency_batch, 1),
                         ("--latency-threads", args.latency_threads, 1),
                         ("--num-tokens", args.num_tokens, 1)):
        if v is not None and v < low:
            raise ValueError(f"{flag} must be >= {low}, got {v}")
    if args.max_steps is not None and not args.finetune_epochs:
        raise ValueError("--max-steps limits fine-tuning: add --finetune-epochs K")
    check_seed(args.seed, "--seed")


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


def _run(args: argparse.Namespace) -> int:
    import torch

    from ..compress.model import compress
    from ..models import create_model
    from ..models.read import read_config
    from ..models.save import write_model_files
    from .evaluate import resolve_checkpoint
    from .finetune import build_image_task, finetune_compressed
    from .train.distributed import resolve_device
    from .train.outputs import staged_output

    say = (lambda _m: None) if args.quiet else (lambda m: print(m, flush=True))
    ckpt, run = resolve_checkpoint(args.checkpoint, prefer_ema=True)  # run dir, final/ or a model dir/file
    check_out(args.out, args.checkpoint, ckpt, args.overwrite)  # before any work
    if args.data is None and run:
        args.data, args.data_dir = run.get("dataset"), args.data_dir or run.get("data_dir")
    name = args.model
    if name is None:
        from ..models.formats.vit_weights import init_kwargs_from_config, is_hf_vit_config, model_name_for

        cfg = read_config(ckpt)
        name = (cfg or {}).get("model_name") or (model_name_for(init_kwargs_from_config(cfg))
                                                 if is_hf_vit_config(cfg) else None)
        if not name:
            raise ValueError(f"--checkpoint {args.checkpoint!r} does not name its model; pass --model NAME")
    if (args.calib or args.finetune_epochs) and not args.data:
        raise ValueError("--calib and --finetune-epochs need --dataset (e.g. --dataset digits)")
    for flag, v in (("--lr", args.lr), ("--weight-decay", args.weight_decay)):
        if not math.isfinite(v) or v < 0 or (flag == "--lr" and v == 0):
            raise ValueError(f"{flag} must be a finite {'positive' if flag == '--lr' else 'non-negative'} number, "
                             f"got {v}")
    _check_counts(args)
    if args.fusion_constraints and not args.finetune_epochs:
        raise ValueError("--fusion-constraints applies to fine-tuning: add --finetune-epochs K")
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    model = create_model(name, checkpoint_path=str(ckpt), **dict(args.model_args)).to(device).eval()

    calib = task = None
    if args.data:
        task = build_image_task(model, args.data, args.data_dir, batch_size=args.batch_size, seed=args.seed,
                                device=device)
        task.eval_progress = not args.quiet  # the accuracies before and after: a bar on a terminal
        if args.calib:
            n = min(args.calib, len(task.train_ds))
            idx = torch.randperm(len(task.train_ds), generator=torch.Generator().manual_seed(args.seed))[:n]
            calib = task.train_ds.get_batch(idx)[0].to(device)

    say(f"compressing {name} ({_sizes(model)}; {args.checkpoint}): qk={args.qk} "
        + (f"qk_rank={args.qk_rank}" if args.qk_rank is not None
           else f"qk_flops_ratio={args.qk_flops_ratio} (protocol {args.protocol})")
        + f", vo_rank={args.vo_rank}, mlp_rank={args.mlp_rank}" + (f", calib={len(calib)} images" if calib is not None
                                                                    else ""))
    t0 = time.perf_counter()
    new, report = compress(
        model, qk=args.qk, qk_rank=args.qk_rank, qk_flops_ratio=args.qk_flops_ratio, vo=args.vo,
        vo_rank=args.vo_rank, mlp_rank=args.mlp_rank, calib=calib, fusion=args.fusion,
        rank_allocation=args.rank_allocation, protocol=args.protocol, blocks=args.blocks, num_tokens=args.num_tokens,
        seed=args.seed, latency_batch=args.latency_batch, latency_runs=args.latency_runs,
        latency_threads=args.latency_threads, allow_growth=args.allow_growth, progress=not args.quiet)
    report.extra["compression_time_s"] = time.perf_counter() - t0
    if task is not None:
        report.extra["accuracy"] = {"original": task.evaluate(model)["acc"], "compressed": task.evaluate(new)["acc"]}
        say(f"{args.data} test accuracy: original {100 * report.extra['accuracy']['original']:.2f} %, compressed "
            f"{100 * report.extra['accuracy']['compressed']:.2f} %")
    if args.finetune_epochs:
        res = finetune_compressed(new, task, epochs=args.finetune_epochs, lr=args.lr, weight_decay=args.weight_decay,
                       fusion_constraints=args.fusion_constraints, max_steps=args.max_steps, log=say)
        report.extra["finetune"] = res
        report.extra["accuracy"]["finetuned"] = res["acc_after"]
    new.eval()
    out = check_out(args.out, args.checkpoint, ckpt, args.overwrite)
    md = report.to_markdown()
    with staged_output(out, overwrite=args.overwrite) as stage:  # moved into --out only once all is written
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


def _split_model_args(argv: List[str]) -> Tuple[List[str], List[Tuple[str, object]]]:
    """``model_args.K=V`` / ``--model-args.K=V`` (the style of ``whiteformer train``) apart from the
    options argparse reads: ``(other words, [(K, value), ...])``."""
    rest: List[str] = []
    pairs: List[Tuple[str, object]] = []
    for tok in argv:
        body = tok[2:] if tok.startswith("--") else tok
        for prefix in ("model_args.", "model-args."):
            if body.startswith(prefix) and "=" in body:
                pairs.append(_model_arg(body[len(prefix):]))
                break
        else:
            rest.append(tok)
    return rest, pairs


def run(args: argparse.Namespace) -> int:
    """``whiteformer compress``: ``args`` parsed by :mod:`whiteformer.app.cli`, ``args.overrides`` the
    words it did not know (``model_args.KEY=VALUE``; anything else is refused). A bad value is a
    :class:`~whiteformer.app.config.ConfigError` (one ``error:`` line, exit code 2)."""
    from .config import ConfigError

    try:
        rest, args.model_args = _split_model_args(args.overrides)
    except argparse.ArgumentTypeError as err:  # a model_args value nested too deeply
        raise ConfigError(str(err)) from None
    if rest:
        raise ConfigError(f"unrecognized arguments: {' '.join(rest)} (see whiteformer compress --help)")
    try:
        return _run(args)
    except (ValueError, TypeError) as err:  # the options' and the compression's argument checks
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from err
