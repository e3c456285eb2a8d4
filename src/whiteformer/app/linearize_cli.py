"""``whiteformer linearize``: a pretrained softmax transformer -> a TSSA (or hybrid) model folder.

    whiteformer linearize --teacher PATH --dataset tokens|text|mnist --data-dir D --out DIR
        [--keep-softmax 0,5] [--transfer-steps N] [--finetune-steps M] [--lora-rank R] [--lr LR]
        [--init vo|qk|random] [--kl-weight W] [--batch-size B] [--block-size T] [--pack] [--seed S]
        [--checkpoint-every K] [--resume] [--overwrite] [--no-progress]

- ``--teacher``: a transformers ``save_pretrained`` folder of a GPT-2 / Llama / Qwen2 / Mistral
  language model or a ViT / DeiT image classifier (read by :func:`whiteformer.convert.from_transformers`,
  no code of it runs), or a whiteformer model folder of a softmax teacher
  (:data:`whiteformer.convert.students.TEACHERS`).
- Data of a language model: ``--dataset tokens`` reads ``D/train.bin`` / ``D/meta.json`` (``whiteformer prepare-text``);
  ``--dataset text`` the text file ``D`` with its tokenizer (``--tokenizer``). Each step draws
  ``--batch-size`` random windows of ``--block-size + 1`` tokens of the train split, as
  ``whiteformer train`` does for language models; a held-out batch of the val split measures the KL
  to the teacher. ``--pack``: the windows' documents (ended by the data's end-of-document token) are
  packed into one row with ``cu_seqlens`` (:func:`~whiteformer.app.data.packing.pack_windows`), so no
  token attends or is predicted across a document boundary.
- Data of an image classifier: ``--dataset mnist`` reads the IDX files in ``D``
  (:func:`whiteformer.app.data.mnist.mnist`), at the teacher's image size; each step draws
  ``--batch-size`` random labelled images of the train split (stage 2: classification loss plus the
  KL), a held-out batch of the test split measures the KL.
- :func:`whiteformer.convert.linearize` trains the student (tqdm bars, the per-layer transfer loss on
  the postfix); its report is printed.
- ``DIR``: the student's ``save_pretrained`` files, the teacher folder's tokenizer files and
  ``generation_config.json`` when it has them, and ``linearize.json`` (the report). ``DIR`` must be
  missing or empty unless ``--overwrite``; it is written beside and moved in as one unit
  (:func:`whiteformer._files.staged_folder`), so a failed run leaves it as it was.
- Resuming: the training state is written to ``DIR.linearize-state.pt`` (beside ``DIR``) every
  ``--checkpoint-every`` steps; ``--resume`` continues an interrupted run from it with the same
  options, ending as the uninterrupted run would. It is removed once ``DIR`` is written. A run that
  finds one without ``--resume`` is refused (``--overwrite`` starts over).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any, Dict, Iterator, List

__all__ = ["add_arguments", "run", "state_path", "TEACHER_FILES"]

#: files of the teacher's folder copied next to the student (when present)
TEACHER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "tokenizer.model", "added_tokens.json", "generation_config.json", "preprocessor_config.json")
#: the ``--dataset`` choices: the token data sets of a language model, the image ones of a classifier
TEXT_DATASETS, IMAGE_DATASETS = ("tokens", "text"), ("mnist",)


def _layers(text: str) -> List[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of layer indices, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``whiteformer linearize`` (its subparser is built by :mod:`whiteformer.app.cli`)."""
    from .config import path_argument

    p.description = ("Linearize a pretrained softmax transformer (a transformers GPT-2 / Llama / Qwen2 / Mistral or "
                     "ViT / DeiT folder, or a whiteformer one) into TSSA: attention transfer, then fine-tuning with "
                     "KL to the teacher.")
    p.add_argument("--teacher", required=True, type=path_argument, help="the teacher's model folder")
    p.add_argument("--dataset", required=True, choices=TEXT_DATASETS + IMAGE_DATASETS,
                   help="the data set of the batches (tokens / text: a language model; mnist: an image classifier)")
    p.add_argument("--data-dir", required=True, type=path_argument,
                   help="tokens: the folder of train.bin / val.bin / meta.json; text: the text file; mnist: the "
                   "folder of its IDX files")
    p.add_argument("--tokenizer", type=path_argument, help="text: the tokenizer (tokenizer.json or a folder; "
                   "default: the teacher folder's)")
    p.add_argument("--out", required=True, type=path_argument, help="output model folder (missing or empty "
                   "unless --overwrite)")
    p.add_argument("--keep-softmax", type=_layers, default=[], metavar="I,J", help="layers that stay softmax")
    p.add_argument("--transfer-steps", type=int, default=100, help="attention-transfer steps (default 100)")
    p.add_argument("--finetune-steps", type=int, default=100, help="fine-tuning steps (default 100)")
    p.add_argument("--lora-rank", type=int, help="fine-tune LoRA adapters of this rank (default: full)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of both stages (default 1e-3)")
    p.add_argument("--init", choices=("vo", "qk", "random"), default="vo", help="TSSA initialisation (default vo)")
    p.add_argument("--kl-weight", type=float, default=1.0, help="weight of the KL to the teacher (default 1)")
    p.add_argument("--batch-size", type=int, default=8, help="windows (or images) per step (default 8)")
    p.add_argument("--block-size", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--pack", action="store_true", help="pack the windows' documents (split at the data's "
                   "end-of-document token) with cu_seqlens")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="K",
                   help="write the training state (OUT.linearize-state.pt) every K steps (default 50)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run of OUT from its state")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (and start over from an "
                   "interrupted run's state)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bars on a terminal (default on)")


def _load_teacher(folder: Path):
    """A softmax teacher (:func:`whiteformer.convert.students.family_of`) from a transformers or
    whiteformer folder; refusals are ConfigErrors."""
    from ..convert import from_transformers
    from ..convert.students import family_of
    from ..models import from_pretrained
    from ..models.read import read_json
    from .config import ConfigError

    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise ConfigError(f"--teacher {str(folder)!r} is not a model folder (it has no config.json)")
    try:
        own = "init_kwargs" in read_json(folder / "config.json")
        model = from_pretrained(folder) if own else from_transformers(folder)
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"--teacher {str(folder)!r}: {err}") from None
    try:
        family_of(model)
    except ValueError as err:
        raise ConfigError(f"--teacher {str(folder)!r}: {err}") from None
    return model.eval()


def _dataset(args: argparse.Namespace, split: str, img_size=None):
    """The ``split`` of ``--dataset`` (images at ``img_size``); its refusals are ConfigErrors."""
    from .config import ConfigError
    from .data.registry import dataset_builder

    if args.dataset in IMAGE_DATASETS:
        kwargs: Dict[str, Any] = {"split": "test" if split == "val" else split, "data_dir": args.data_dir,
                                  "img_size": img_size}
    else:
        kwargs = {"split": split, "data_dir": args.data_dir, "pack": bool(args.pack)}
    if args.dataset == "text":
        tok = args.tokenizer or (args.teacher if (Path(args.teacher) / "tokenizer.json").is_file() else None)
        if tok is None:
            raise ConfigError("--dataset text needs a tokenizer: --tokenizer, or a tokenizer.json in the teacher folder")
        kwargs["tokenizer"] = tok
    try:
        return dataset_builder(args.dataset)(**kwargs)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise ConfigError(f"--dataset {args.dataset} --data-dir {args.data_dir!r}: {err}") from None


def _windows(ds, batch_size: int, block_size: int, seed: int, pack: bool = False) -> Iterator[Dict[str, Any]]:
    """Random windows of ``block_size + 1`` tokens: {"idx", "targets"} (B, block_size) each, or with
    ``pack`` the packed row {"idx", "targets"} (1, B * block_size) and its "cu_seqlens"."""
    import torch

    from .data.packing import pack_windows

    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ds) - block_size - 1, (batch_size,), generator=g)
        x, y = ds.get_windows(starts, block_size)
        if pack:
            packed, y = pack_windows(x, y, ds.eod_id)
            yield {"idx": packed.idx, "targets": y, "cu_seqlens": packed.cu_seqlens}
        else:
            yield {"idx": x, "targets": y}


def _images(ds, batch_size: int, seed: int) -> Iterator[Any]:
    """Random ``(images (B, C, H, W), labels (B,))`` batches of ``ds``, ``batch_size`` each."""
    import torch

    g = torch.Generator().manual_seed(seed)
    while True:
        yield ds.get_batch(torch.randint(0, len(ds), (batch_size,), generator=g))


def _check_kind(args: argparse.Namespace, teacher) -> None:
    """``--dataset`` is of the teacher's kind: images for an image classifier, tokens for a language model."""
    from ..convert.students import family_of
    from .config import ConfigError

    kind = family_of(teacher).kind
    image = args.dataset in IMAGE_DATASETS
    if image != (kind == "image classifier"):
        raise ConfigError(f"--dataset {args.dataset} is {'an image' if image else 'a token'} data set, but the teacher "
                          f"is {'an' if kind[0] in 'aeiou' else 'a'} {kind} ({type(teacher).__name__}); use --dataset "
                          f"{'|'.join(TEXT_DATASETS if image else IMAGE_DATASETS)}")


def _check_data(args: argparse.Namespace, teacher, train, val) -> None:
    """The data fit the teacher: its vocabulary and lengths, or its image channels and classes."""
    from .config import ConfigError

    image = args.dataset in IMAGE_DATASETS
    for ds in (train, val):
        if image:
            chans = teacher.init_kwargs.get("in_chans")
            if ds.in_chans != chans:
                raise ConfigError(f"{ds.name}: its images have {ds.in_chans} channel(s), the teacher takes {chans}")
            if ds.num_classes > teacher.num_classes:
                raise ConfigError(f"{ds.name}: its {ds.num_classes} classes are more than the teacher's "
                                  f"{teacher.num_classes}")
            continue
        if ds.vocab_size > teacher.vocab_size:
            raise ConfigError(f"the data's vocabulary ({ds.vocab_size} token ids) is larger than the teacher's "
                              f"({teacher.vocab_size}): its ids were not made for this model")
        if len(ds) < args.block_size + 2:
            raise ConfigError(f"{ds.name}: {len(ds)} tokens are fewer than --block-size + 2 = {args.block_size + 2}")


def _check(args: argparse.Namespace) -> None:
    from .config import ConfigError

    for name in ("transfer_steps", "finetune_steps"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    optional = ("lora_rank",) if args.lora_rank is not None else ()
    for name in ("batch_size", "block_size", "checkpoint_every") + optional:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    if args.pack and args.dataset in IMAGE_DATASETS:
        raise ConfigError(f"--pack packs documents of token data; --dataset {args.dataset} holds images")
    if not 0 <= args.kl_weight < float("inf"):
        raise ConfigError(f"--kl-weight must be a finite number >= 0, got {args.kl_weight}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {args.out!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ConfigError(f"--out {args.out!r} is not empty (pass --overwrite to replace it)")
    state = state_path(args.out)
    if args.resume and not state.is_file():
        raise ConfigError(f"--resume: there is no interrupted run of --out {args.out!r} ({str(state)!r} is missing)")
    if state.exists() and not (args.resume or args.overwrite):
        raise ConfigError(f"an interrupted run of --out {args.out!r} left {str(state)!r}: pass --resume to continue "
                          "it, or --overwrite to start over")


def state_path(out) -> Path:
    """Where the training state of the run writing ``out`` is kept: ``OUT.linearize-state.pt`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".linearize-state.pt")


def run(args: argparse.Namespace) -> int:
    """``whiteformer linearize``: ``args`` parsed by :mod:`whiteformer.app.cli`."""
    from .._files import staged_folder, write_text
    from ..convert import linearize
    from .config import ConfigError
    from .train.outputs import say

    _check(args)
    teacher = _load_teacher(Path(args.teacher))
    _check_kind(args, teacher)
    image = args.dataset in IMAGE_DATASETS
    size = teacher.init_kwargs.get("img_size") if image else None
    train, val = _dataset(args, "train", size), _dataset(args, "val", size)
    _check_data(args, teacher, train, val)
    if image:
        held, batches = next(_images(val, args.batch_size, args.seed + 1)), _images(train, args.batch_size, args.seed)
    else:
        held = next(_windows(val, args.batch_size, args.block_size, args.seed + 1, args.pack))
        batches = _windows(train, args.batch_size, args.block_size, args.seed, args.pack)
    state_path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        student, res = linearize(teacher, batches,
                                 keep_softmax=args.keep_softmax, transfer_steps=args.transfer_steps,
                                 finetune_steps=args.finetune_steps, lr=args.lr, init=args.init,
                                 lora_rank=args.lora_rank, kl_weight=args.kl_weight, eval_batch=held, seed=args.seed,
                                 progress=args.progress, checkpoint=state_path(args.out),
                                 checkpoint_every=args.checkpoint_every, resume=args.resume)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    report = {"teacher": str(args.teacher), "dataset": args.dataset, "keep_softmax": args.keep_softmax,
              "transfer_steps": args.transfer_steps, "finetune_steps": args.finetune_steps,
              "lora_rank": args.lora_rank, "init": args.init, "pack": args.pack, "tssa_layers": res.tssa_layers,
              "transfer_before": res.transfer_before, "transfer_after": res.transfer_after,
              "kl_swap": res.kl_swap, "kl_transfer": res.kl_transfer, "kl_finetune": res.kl_finetune}
    with staged_folder(args.out, keep=False) as stage:
        student.save_pretrained(stage)
        for name in TEACHER_FILES:
            src = Path(args.teacher) / name
            if src.is_file():
                shutil.copyfile(src, stage / name)
        write_text(stage / "linearize.json", json.dumps(report, indent=2) + "\n")
    state_path(args.out).unlink(missing_ok=True)
    say("transfer loss per TSSA layer: " + ", ".join(
        f"{i}: {a:.4g} -> {b:.4g}" for i, a, b in zip(res.tssa_layers, res.transfer_before, res.transfer_after)))
    say(f"KL to the teacher (val batch): plain swap {res.kl_swap:.4g}, after transfer {res.kl_transfer:.4g}, "
        f"after fine-tuning {res.kl_finetune:.4g}")
    say(f"model: {args.out} (whiteformer.from_pretrained)")
    return 0
