"""Configuration of the ``whiteformer`` commands: one dataclass per command (``TrainConfig``,
``EvalConfig``, ``GenerateConfig``, ``AnalyzeConfig``), filled from its defaults, a YAML file and
command-line overrides (in that order of precedence, the last winning); ``validate()`` checks what
can be checked without touching data or models.

Override syntax (``parse_overrides``): ``--lr 1e-3``, ``--lr=1e-3``, ``lr=1e-3``; booleans
``--ema`` / ``--no-ema`` / ``ema=false``; dashes in names are underscores; dict fields take
dotted keys, ``model_args.embed_dim=64`` (or a whole YAML mapping, ``model_args={embed_dim: 64}``).
Values are converted to the field's type; unknown names and unconvertible values raise
:class:`ConfigError` saying what to fix.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

from .._checks import is_int, is_real
from .._nesting import NestingError, check_nesting, parse_bounded
from .._registry import did_you_mean
from ..models.lm import check_temperature
from .schedule import SCHEDULES

__all__ = ["TrainConfig", "EvalConfig", "GenerateConfig", "AnalyzeConfig", "ConfigError", "check_seed", "check_device",
           "RUN_DEFINING", "changed_run_options", "parse_overrides", "config_from_args", "parse_value", "build_config", "config_to_dict",
           "save_config", "load_yaml", "format_fields"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts."""


def _h(text: str, path: bool = False, **kw):
    """A field with its ``--help`` text; ``path``: it names a file or folder (an empty one is refused)."""
    return field(metadata={"help": text, **({"path": True} if path else {})}, **kw)


def check_path_option(name: str, value: Any) -> None:
    """A path option given empty (``--out ""``, an unset shell variable) is an error, never the working directory."""
    from .._files import check_path

    if value is not None:
        try:
            check_path(value, name)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def path_argument(text: str) -> str:
    """argparse ``type=`` of a path option or argument: an empty one is a usage error (one line, exit 2)."""
    import argparse

    from .._files import EMPTY_PATH

    if text == "":
        raise argparse.ArgumentTypeError(EMPTY_PATH)
    return text


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_finite(cfg) -> None:
    """Every number of a configuration is finite (``--lr inf`` / ``nan`` are refused up front)."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{f.name} must be a finite number, got {v!r}")


#: the seeds torch.manual_seed takes (a 64-bit integer); negative seeds are refused as well
MAX_SEED = 2 ** 63 - 1
#: the largest integer option (a 64-bit integer: what torch and NumPy index with)
MAX_INT = 2 ** 63 - 1
#: the most epochs / optimizer steps a run may ask for (a million epochs; 10**12 steps: at 10,000 steps a
#: second, three years)
MAX_EPOCHS = 10 ** 6
MAX_STEPS = 10 ** 12


def check_seed(seed, name: str = "seed") -> int:
    """A seed in [0, 2**63 - 1] (``torch.manual_seed`` overflows beyond 64 bits)."""
    _check(is_int(seed) and 0 <= seed <= MAX_SEED, f"{name} must be an integer in [0, 2**63 - 1], got {seed!r}")
    return int(seed)


def check_device(spec: str):
    """``torch.device(spec)``, or a :class:`ConfigError` naming the accepted forms ("auto" is
    resolved by :func:`whiteformer.app.train.distributed.resolve_device`, not here)."""
    import torch

    try:
        return torch.device(spec)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ConfigError(f"device must be auto, cpu, cuda, cuda:N (or another torch device), got {spec!r} "
                          f"({str(err).splitlines()[0]})") from None


def max_threads() -> int:
    """The most ``num_threads`` accepted: 4 per CPU core (1024 at least). Far more made OpenMP fail to
    create its threads (``libgomp: Thread creation failed``) or the process crash (100000: SIGSEGV)."""
    return max(1024, 4 * (os.cpu_count() or 1))


def check_recipe(cfg) -> None:
    """The vision-recipe options of ``cfg`` (RandAugment, Mixup / CutMix, erasing, repeats) in range."""
    from .data.recipe import VisionRecipe

    try:
        VisionRecipe.from_options(dataclasses.asdict(cfg)).check()
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_device_name(spec: str) -> None:
    if spec not in ("auto", ""):
        check_device(spec)


@dataclass
class TrainConfig:
    """``whiteformer train``: train (or fine-tune) a model on a dataset."""

    # model
    model: str = _h("registered model name (whiteformer list-models)", default="tost_t12_p16")
    model_args: Dict[str, Any] = _h("constructor overrides, e.g. model_args.embed_dim=64", default_factory=dict)
    finetune: Optional[str] = _h("checkpoint to start from (own dir, official ToST .pth, timm); the head "
                                 "is reset when the number of classes differs", path=True, default=None)
    # data
    dataset: str = _h("dataset name: {datasets} (whiteformer list-datasets)", default="digits")
    data_dir: Optional[str] = _h("data directory (mnist, image-folder) or text file (text)", path=True, default=None)
    data_args: Dict[str, Any] = _h("dataset options, e.g. data_args.img_size=16", default_factory=dict)
    eval_split: str = _h("split used for evaluation", default="test")
    translate: int = _h("augmentation: random translation in pixels (0: off; image datasets)", default=1)
    flip: float = _h("augmentation: horizontal-flip probability", default=0.0)
    crop_scale: Optional[List[float]] = _h("image datasets: random resized crops of this range of the area, e.g. "
                                           "[0.08, 1.0] (timm's --scale; image-folder crops the files' own pixels; "
                                           "none: off)", default=None)
    crop_ratio: List[float] = _h("random resized crops: range of the aspect ratio (width / height)",
                                 default_factory=lambda: [3 / 4, 4 / 3])
    auto_augment: Optional[str] = _h("image datasets: RandAugment as timm's string, e.g. rand-m9-mstd0.5-inc1 "
                                     "(m magnitude, n ops, mstd magnitude noise, inc1 increasing ops; none: off)",
                                     default=None)
    mixup: float = _h("image datasets: Mixup Beta alpha (0: off; DeiT 0.8); targets get label_smoothing", default=0.0)
    cutmix: float = _h("image datasets: CutMix Beta alpha (0: off; DeiT 1.0)", default=0.0)
    mixup_prob: float = _h("probability of mixing a batch (or image, mixup_mode=elem)", default=1.0)
    mixup_switch_prob: float = _h("probability of CutMix rather than Mixup when both are on", default=0.5)
    mixup_mode: str = _h("Mixup / CutMix parameters per 'batch' or per image ('elem')", default="batch")
    reprob: float = _h("image datasets: random-erasing probability per image (0: off; DeiT 0.25)", default=0.0)
    remode: str = _h("random-erasing fill: const (mean colour), rand (a colour per box), pixel (noise)",
                     default="pixel")
    recount: int = _h("random erasing: at most this many boxes per erased image", default=1)
    aug_repeats: int = _h("image datasets: repeated augmentation, each image this many times per epoch on "
                          "different processes (0 or 1: off; DeiT 3)", default=0)
    aug_impl: str = _h("RandAugment / Mixup / erasing from timm (needs torchvision), the built-in torch ones, "
                       "or auto (timm when it imports)", default="auto")
    block_size: int = _h("language models: context length of the training windows", default=128)
    unlimited_length: bool = _h("language models built from scratch: no absolute positions / position bias where the "
                                "model allows (ToST: pos_emb=False, pos_bias=False), so they generate past block_size; "
                                "the `whiteformer train` command's default", default=False)
    # optimisation
    epochs: int = _h("training epochs (image / sequence datasets)", default=30)
    steps: int = _h("total optimizer steps; > 0 overrides epochs (required for text)", default=0)
    batch_size: int = _h("global batch size (split over the DDP processes)", default=64)
    context_parallel: int = _h("split every training sequence over this many processes (context parallelism, "
                               "under torchrun; text datasets and ToST language models); the WORLD_SIZE / R groups "
                               "of R consecutive ranks are data-parallel", default=1)
    lr: float = _h("peak learning rate (AdamW)", default=1e-3)
    min_lr: float = _h("final learning rate (cosine, linear) or floor (inverse_sqrt) of the schedule", default=1e-5)
    schedule: str = _h("learning-rate decay after the linear warm-up: cosine, linear, inverse_sqrt "
                       "(ToST Table 7: inverse_sqrt for LRA ListOps, linear for the other LRA tasks)", default="cosine")
    weight_decay: float = _h("AdamW weight decay (not on biases, norms, no_weight_decay())", default=0.05)
    beta1: float = _h("AdamW beta1", default=0.9)
    beta2: float = _h("AdamW beta2", default=0.999)
    warmup_steps: int = _h("linear warm-up steps (overrides warmup_epochs when > 0)", default=0)
    warmup_epochs: float = _h("linear warm-up length in epochs", default=0.0)
    label_smoothing: float = _h("label smoothing of the cross-entropy (classification)", default=0.0)
    clip_grad: float = _h("gradient-norm clipping (0: off)", default=1.0)
    ema: bool = _h("keep an exponential moving average of the weights (used for evaluation)", default=False)
    ema_decay: float = _h("EMA decay per step", default=0.999)
    bf16: bool = _h("bfloat16 autocast for forward/backward (the same as --precision bf16)", default=False)
    precision: str = _h("fp32, bf16 (bfloat16 autocast) or fp16 (float16 autocast with gradient scaling); "
                        "statistics and the loss stay in float32", default="fp32")
    fsdp: bool = _h("shard parameters, gradients and optimizer state over the torchrun processes (FSDP2 "
                    "fully_shard per block and the root) instead of DistributedDataParallel", default=False)
    compile: bool = _h("torch.compile the model", default=False)
    # run
    seed: int = _h("random seed (model init, data order, augmentation)", default=0)
    device: str = _h("device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...", default="auto")
    num_threads: int = _h("torch CPU threads (0: torch default)", default=0)
    deterministic: bool = _h("torch.use_deterministic_algorithms(True)", default=False)
    out: str = _h("run directory (config, logs, checkpoints, report)", path=True, default="runs/train")
    overwrite: bool = _h("replace the run in --out: its files are moved aside and deleted once the new run has its "
                         "final model (other files are kept)", default=False)
    resume: bool = _h("continue from the newest valid checkpoint in the run directory", default=False)
    ckpt_every: int = _h("checkpoint every k steps (0: at the end of every epoch; LM: 10 times per run)", default=0)
    ckpt_minutes: float = _h("also checkpoint when this many minutes passed since the last one (0: off); "
                             "Ctrl-C / SIGTERM always save one", default=10.0)
    keep_last: int = _h("checkpoints to keep", default=3)
    eval_every: int = _h("evaluate every k steps (0: every epoch; LM: 10 times per run)", default=0)
    eval_batches: int = _h("language models: validation windows = eval_batches x batch_size", default=10)
    log_every: int = _h("log training metrics every k steps", default=10)
    progress: bool = _h("tqdm progress bar on a terminal (else, and without a terminal: one line per "
                        "evaluation, i.e. per epoch)", default=True)
    tensorboard: bool = _h("also log to TensorBoard when it is installed", default=True)
    report: bool = _h("write the run report (markdown + PNGs) at the end", default=True)
    report_images: int = _h("test images shown in the membership maps", default=4)

    def validate(self) -> None:
        _check_finite(self)
        _check(bool(self.model), "model must be a registered model name (whiteformer list-models)")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        _check(not (self.bf16 and self.precision == "fp16"), "bf16 and precision=fp16 exclude each other: pick one")
        _check(not (self.fsdp and self.ema), "fsdp and ema exclude each other (the EMA copy would not be sharded)")
        _check(not (self.fsdp and self.context_parallel > 1), "fsdp and context_parallel exclude each other")
        _check(not (self.fsdp and self.precision == "fp16"), "fsdp with precision fp16 is not supported (gradient "
               "scaling of sharded gradients); use precision bf16, which needs no scaling")
        _check(self.epochs >= 1 or self.steps >= 1, "give epochs >= 1 or steps >= 1")
        _check(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        _check(self.epochs <= MAX_EPOCHS, f"epochs must be at most {MAX_EPOCHS}, got {self.epochs}")
        _check(self.steps <= MAX_STEPS, f"steps must be at most {MAX_STEPS}, got {self.steps}")
        _check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _check(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        _check(self.schedule in SCHEDULES, f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1 and beta2 must be in [0, 1)")
        _check(self.warmup_steps >= 0 and self.warmup_epochs >= 0, "warm-up lengths must be >= 0")
        _check(0 <= self.label_smoothing < 1, f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        _check(self.clip_grad >= 0, f"clip_grad must be >= 0 (0: off), got {self.clip_grad}")
        _check(0 < self.ema_decay < 1, f"ema_decay must be in (0, 1), got {self.ema_decay}")
        _check(self.translate >= 0, f"translate must be >= 0 pixels, got {self.translate}")
        _check(0 <= self.flip <= 1, f"flip must be a probability in [0, 1], got {self.flip}")
        check_recipe(self)
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(self.context_parallel >= 1, f"context_parallel must be >= 1, got {self.context_parallel}")
        _check(not (self.context_parallel > 1 and self.compile),
               "context_parallel and compile cannot be combined (the split ops' collectives are not compiled); "
               "drop --compile")
        _check(self.block_size >= self.context_parallel,
               f"block_size {self.block_size} must be >= context_parallel {self.context_parallel} (a token per process)")
        _check(self.ckpt_every >= 0 and self.eval_every >= 0 and self.log_every >= 1,
               "ckpt_every and eval_every must be >= 0, log_every >= 1")
        _check(self.keep_last >= 1, f"keep_last must be >= 1, got {self.keep_last}")
        _check(self.eval_batches >= 1, f"eval_batches must be >= 1, got {self.eval_batches}")
        _check(0 <= self.num_threads <= max_threads(), f"num_threads must be in [0, {max_threads()}] (0: torch's "
               f"default; at most 4 per CPU core, 1024 at least), got {self.num_threads}")
        _check(self.ckpt_minutes >= 0, f"ckpt_minutes must be >= 0 (0: off), got {self.ckpt_minutes}")
        _check(not (self.resume and self.overwrite), "resume and overwrite exclude each other: pick one")
        _check(not (self.resume and self.finetune), "resume continues a run; finetune starts a new one: pick one")
        _check(self.report_images >= 0, f"report_images must be >= 0, got {self.report_images}")
        check_seed(self.seed)
        _check_device_name(self.device)


#: the options that define what a run computes (its model, data, optimisation and random streams):
#: ``--resume`` refuses a change to any of them. ``epochs`` / ``steps`` may grow (extending a run),
#: and the others (device, threads, logging, checkpointing, evaluation and report options,
#: ``data_dir`` when the data moved, ``context_parallel``) leave the trained weights unchanged.
#: ``--precision``: the autocast dtype of forward/backward (fp16 adds gradient scaling)
PRECISIONS = ("fp32", "bf16", "fp16")


def amp_precision(cfg: "TrainConfig") -> str:
    """The precision a run trains in (``bf16=true`` is ``precision=bf16``)."""
    return "bf16" if cfg.bf16 else cfg.precision


RUN_DEFINING = ("model", "model_args", "finetune", "dataset", "data_args", "translate", "flip", "crop_scale", "crop_ratio", "auto_augment",
                "mixup", "cutmix", "mixup_prob", "mixup_switch_prob", "mixup_mode", "reprob", "remode", "recount",
                "aug_repeats", "aug_impl", "block_size",
                "unlimited_length", "batch_size", "lr", "min_lr", "schedule", "weight_decay", "beta1", "beta2",
                "warmup_steps", "warmup_epochs", "label_smoothing", "clip_grad", "ema", "ema_decay", "bf16", "precision",
                "seed")


def changed_run_options(saved: Optional[Dict[str, Any]], cfg: "TrainConfig") -> List[Tuple[str, Any, Any]]:
    """``(name, the run's value, cfg's value)`` for each :data:`RUN_DEFINING` option that differs
    between a run's saved configuration (a checkpoint's ``config``) and ``cfg`` ([] without one)."""
    import json

    if not isinstance(saved, dict):
        return []
    now = config_to_dict(cfg)
    same = lambda a, b: json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)  # noqa: E731
    return [(k, saved[k], now[k]) for k in RUN_DEFINING if k in saved and not same(saved[k], now[k])]


@dataclass
class EvalConfig:
    """``whiteformer eval``: accuracy / loss of a checkpoint on a dataset split."""

    checkpoint: str = _h("run directory, its final/ or a checkpoint dir (own format), or a foreign file", path=True,
                         default="")
    model: Optional[str] = _h("model name (needed for foreign checkpoint files)", default=None)
    model_args: Dict[str, Any] = _h("constructor overrides (foreign checkpoints)", default_factory=dict)
    dataset: Optional[str] = _h("dataset (default: the one the run was trained on)", default=None)
    data_dir: Optional[str] = _h("data directory / text file", path=True, default=None)
    data_args: Dict[str, Any] = _h("dataset options (default: the run's)", default_factory=dict)
    split: str = _h("split to evaluate", default="test")
    batch_size: int = _h("batch size", default=256)
    block_size: int = _h("language models: window length (default: the run's)", default=0)
    eval_batches: int = _h("language models: number of batches", default=10)
    ema: bool = _h("use the EMA weights of a run when present", default=True)
    device: str = _h("device (auto: cuda if available)", default="auto")
    json: bool = _h("print the result as JSON", default=False)
    progress: bool = _h("tqdm progress bar over the batches on a terminal (--no-progress: none)", default=True)

    def validate(self) -> None:
        _check_finite(self)
        _check(bool(self.checkpoint), "give --checkpoint (a run directory or a checkpoint)")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.block_size >= 0, f"block_size must be >= 1 (0: the run's), got {self.block_size}")
        _check(self.eval_batches >= 1, f"eval_batches must be >= 1, got {self.eval_batches}")
        _check_device_name(self.device)


@dataclass
class GenerateConfig:
    """``whiteformer generate``: sample text from a language-model checkpoint."""

    checkpoint: str = _h("run directory or its final/ (with vocab.json or tokenizer.json)", path=True, default="")
    prompt: str = _h("text to continue", default="\n")
    max_new_tokens: int = _h("tokens to generate at most (characters for a character vocabulary); a sample ends "
                             "earlier at the model's end-of-document token", default=300)
    temperature: float = _h("sampling temperature (0: greedy)", default=0.8)
    top_k: int = _h("top-k filter (0: off)", default=0)
    num_samples: int = _h("independent samples", default=1)
    seed: int = _h("sampling seed", default=0)
    ignore_eos: bool = _h("keep generating past the end-of-document token (<|endoftext|>) up to max_new_tokens",
                          default=False)
    device: str = _h("device (auto: cuda if available)", default="auto")

    def validate(self) -> None:
        _check_finite(self)
        _check(bool(self.checkpoint), "give --checkpoint (a language-model run directory)")
        _check(self.max_new_tokens >= 0, "max_new_tokens must be >= 0")
        try:
            check_temperature(self.temperature)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        _check(self.top_k >= 0, "top_k must be >= 0 (0: off)")
        _check(self.num_samples >= 1, "num_samples must be >= 1")
        check_seed(self.seed)
        _check_device_name(self.device)


@dataclass
class AnalyzeConfig:
    """``whiteformer analyze <analysis>``: the options of every analysis (each analysis's own options
    are the fields of its subclass, :mod:`whiteformer.app.analyze`)."""

    out: str = _h("output directory (missing or empty unless --overwrite)", path=True, default="runs/analysis")
    seed: int = _h("random seed", default=0)
    plots: bool = _h("write PNG figures (needs matplotlib)", default=True)
    overwrite: bool = _h("write into a non-empty --out, replacing the files of the same names (others are kept)",
                         default=False)
    progress: bool = _h("tqdm progress bar on a terminal (--no-progress: none)", default=True)

    def validate(self) -> None:
        _check_finite(self)
        check_seed(self.seed)


def parse_value(text: str) -> Any:
    """A command-line string as a Python value: int, float (``1e-3`` too), bool, None, or YAML
    (lists / mappings), else the string itself."""
    s = text.strip()
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    low = s.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null", "~"):
        return None
    if s[:1] in ("[", "{"):
        import yaml

        try:
            return parse_bounded(lambda: yaml.safe_load(s))
        except yaml.YAMLError as err:
            raise ConfigError(f"cannot parse {text!r} as a YAML list/mapping: {yaml_error_line(err)}") from None
        except NestingError as err:
            shown = text if len(text) <= 40 else text[:40] + "..."
            raise ConfigError(f"cannot parse {shown!r} as a YAML list/mapping: it {err}") from None
    return str(text)  # a plain str, never a Raw: the run's config.yaml is written with yaml.safe_dump


class Raw(str):
    """A command-line value not yet converted: string options keep the text as typed (``--prompt
    true`` is the text "true"), other options parse it with :func:`parse_value`."""


def parse_overrides(tokens: Sequence[str], positional: Optional[str] = None) -> List[Tuple[str, Any]]:
    """``["--lr", "1e-3", "epochs=3", "--ema", "--no-progress"]`` -> [("lr", "1e-3"), ("epochs", "3"),
    ("ema", True), ("progress", False)] (names with dashes turned into underscores; the values are
    :class:`Raw` strings, converted to the option's type by :func:`build_config`). With
    ``positional``, the words that are neither an option, its value nor ``key=value`` are that
    list option's values, in order (``prepare-text a.txt b.txt --out DIR``: ``("inputs", [a.txt, b.txt])``)."""
    out: List[Tuple[str, Any]] = []
    words: List[str] = []
    i = 0
    toks = list(tokens)
    while i < len(toks):
        tok = toks[i]
        if tok.startswith("--"):
            body = tok[2:]
            if not body:
                raise ConfigError("empty option '--'")
            if "=" in body:
                key, val = body.split("=", 1)
                out.append((key.replace("-", "_"), Raw(val)))
            elif i + 1 < len(toks) and not (toks[i + 1].startswith("--") or _is_assignment(toks[i + 1])):
                out.append((body.replace("-", "_"), Raw(toks[i + 1])))
                i += 1
            elif body.startswith("no-") or body.startswith("no_"):
                out.append((body[3:].replace("-", "_"), False))
            else:
                out.append((body.replace("-", "_"), True))
        elif _is_assignment(tok):
            key, val = tok.split("=", 1)
            out.append((key.replace("-", "_"), Raw(val)))
        elif positional is not None:
            if not words:
                out.append((positional, words))
            words.append(tok)
        else:
            raise ConfigError(f"unexpected argument {tok!r}: use --key value or key=value")
        i += 1
    return out


def _is_assignment(tok: str) -> bool:
    if tok.startswith("-") or "=" not in tok:
        return False
    key = tok.split("=", 1)[0]
    return key.replace("_", "").replace("-", "").replace(".", "").isalnum()


def _strip_optional(tp) -> Tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else Any), True
    return tp, False


def _coerce(name: str, value: Any, tp) -> Any:
    base, optional = _strip_optional(tp)
    if isinstance(value, Raw):
        if base is str and not (optional and value.strip().lower() in ("none", "null", "~")):
            return str(value)
        value = parse_value(value)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} cannot be null")
    origin = typing.get_origin(base) or base
    if base is Any:
        return value
    if origin is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if origin is int:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite integer, got {value!r}")
        if not (is_int(value) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        if abs(value) > MAX_INT and not name.endswith("seed"):  # (a seed's own check names its range)
            raise ConfigError(f"{name} must be an integer below 2**63 in size (a 64-bit integer), got {value!r}")
        return int(value)
    if origin is float:
        if is_real(value):
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if origin is str:
        if isinstance(value, str) or is_real(value):
            return str(value)
        raise ConfigError(f"{name} must be a string, got {value!r}")
    if origin in (dict, Dict):
        if isinstance(value, dict):
            return dict(value)
        if value is True:  # a bare --model-args (its value written as a separate key=value word)
            raise ConfigError(f"--{name.replace('_', '-')} takes a mapping: write {name}.key=value for each key "
                              f"(e.g. {name}.dim=64) or --{name.replace('_', '-')} '{{dim: 64}}'")
        raise ConfigError(f"{name} must be a mapping (e.g. {name}.key=value), got {value!r}")
    if origin in (list, List, tuple):
        if isinstance(value, str) and "," in value:  # 4,4,8: a list of numbers written as one word
            value = [parse_value(v) for v in value.split(",")]
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        elem = (typing.get_args(base) or (Any,))[0]
        if elem in (int, float):  # a list of numbers: each converted and checked as the option's own value
            items = [_coerce(f"{name}[{i}]", v, elem) for i, v in enumerate(items)]
        return items
    return value


def _fields(cls) -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _unknown(cls, key: str) -> ConfigError:
    names = list(_fields(cls))
    return ConfigError(f"unknown option {key!r} for {cls.__name__}{did_you_mean(key, names)}; "
                       f"valid options: {', '.join(names)}")


def yaml_error_line(err) -> str:
    """One line for a ``yaml.YAMLError``: the problem and where (line, column; 1-based)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


def config_file(arg) -> Path:
    """The file of ``-c ARG``: ``ARG`` itself when it exists, else the shipped config of that name
    (``whiteformer list-configs``); an error names both when neither is there."""
    from .configs import list_configs, shipped_config

    check_path_option("-c/--config", arg)
    path = Path(arg).expanduser()
    if path.exists() or path.is_symlink():
        return path
    shipped = shipped_config(str(arg))
    if shipped is None:
        raise ConfigError(f"config file {str(arg)!r} does not exist, and no shipped config has that name "
                          f"(shipped: {', '.join(list_configs())}; see whiteformer list-configs)")
    return shipped


def load_yaml(path) -> Dict[str, Any]:
    import stat

    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory, not a YAML file")
    mode = p.stat().st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):  # a pipe (-c <(...)) is read; a device is not
        raise ConfigError(f"config file {str(p)!r} is not a regular file (a YAML file expected)")
    try:
        with open(p, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {yaml_error_line(err)}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(p)!r} is not a UTF-8 text file (YAML expected): {err}") from err
    except RecursionError:
        raise ConfigError(f"config file {str(p)!r} {NestingError()}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of option: value")
    if _expanded_size(data, MAX_CONFIG_VALUES) > MAX_CONFIG_VALUES:
        raise ConfigError(f"config file {str(p)!r} expands to more than {MAX_CONFIG_VALUES} values (YAML aliases "
                          f"repeating each other, a 'billion laughs'); a configuration is a few dozen options")
    try:
        check_nesting(data)
    except NestingError as err:
        raise ConfigError(f"config file {str(p)!r} {err}") from None
    return data


#: the most values (scalars, lists, mappings, counted as read with aliases expanded) a config file may hold
MAX_CONFIG_VALUES = 100_000


def _expanded_size(data: Any, limit: int) -> int:
    """The number of values in ``data`` with YAML aliases expanded (a shared list counts each time it
    is used: what printing or copying it costs), counting stops past ``limit``."""
    n, todo = 0, [data]
    while todo and n <= limit:
        v = todo.pop()
        n += 1
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
    return n


def config_from_args(cls: Type[T], args, base=None, positional: Optional[str] = None) -> T:
    """``cls`` of a command parsed by :mod:`whiteformer.app.cli`: its defaults, ``base(overrides)`` (a
    mapping or None), ``-c FILE`` (``args.config``) and the words the parser did not know
    (``args.overrides``, :func:`parse_overrides`; ``positional``: the list option bare words fill)."""
    overrides = parse_overrides(args.overrides, positional=positional)
    start = base(overrides) if base is not None else None
    return build_config(cls, getattr(args, "config", None), overrides, base=start)


def build_config(cls: Type[T], yaml_path=None, overrides: Union[Sequence[Tuple[str, Any]], Dict[str, Any], None] = None,
                 base: Optional[Dict[str, Any]] = None) -> T:
    """``cls`` from its defaults, then ``base`` (a mapping), the YAML file, then ``overrides``."""
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    values: Dict[str, Any] = {}
    for f in fields.values():
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            values[f.name] = f.default_factory()  # type: ignore[misc]

    def assign(key: str, value: Any, where: str) -> None:
        key = key.replace("-", "_")
        if "." in key:
            top, sub = key.split(".", 1)
            if top not in fields:
                raise _unknown(cls, top)
            base_t, _ = _strip_optional(hints[top])
            if (typing.get_origin(base_t) or base_t) not in (dict, Dict):
                raise ConfigError(f"{top} is not a mapping option; {key!r} ({where}) is invalid")
            d = dict(values.get(top) or {})
            d[sub] = parse_value(value) if isinstance(value, Raw) else value
            values[top] = d
            return
        if key not in fields:
            raise _unknown(cls, key)
        values[key] = _coerce(key, value, hints[key])
        if fields[key].metadata.get("path"):
            check_path_option(key, values[key])

    from_file = load_yaml(config_file(yaml_path)) if yaml_path is not None else {}
    for src, where in ((base or {}, "base"), (from_file, str(yaml_path))):
        for k, v in src.items():
            assign(str(k), v, where)
    items = overrides.items() if isinstance(overrides, dict) else (overrides or [])
    for k, v in items:
        assign(k, v, "command line")
    missing = [n for n in fields if n not in values]
    if missing:
        raise ConfigError(f"{cls.__name__}: required option(s) {missing} not given")
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def config_to_dict(cfg) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg, path) -> None:
    """Write the resolved configuration as YAML (atomically)."""
    import yaml

    from .._files import write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def format_fields(cls, skip: Sequence[str] = ()) -> str:
    """Help text: one line per option with its default and description (``metadata["help"]``), but
    the options named in ``skip``."""
    lines = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        text = f.metadata.get("help", "")
        if "{datasets}" in text:  # the registered names, never a list that falls behind
            from .data import list_datasets

            text = text.replace("{datasets}", ", ".join(list_datasets()))
        lines.append(f"  --{f.name.replace('_', '-'):22s} {text} [default: {default!r}]")
    return "\n".join(lines)
