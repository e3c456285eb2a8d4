"""Configuration dataclasses of the ``whiteformer`` commands (one per command).

Each is filled by :func:`whiteformer.train.configuration.build_config` from its defaults, a YAML
file (``-c FILE``) and command-line overrides; ``validate()`` checks what can be checked without
touching data or models.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .configuration import ConfigError

__all__ = ["TrainConfig", "EvalConfig", "GenerateConfig", "AnalyzeConfig", "ConfigError"]


def _h(text: str, **kw):
    return field(metadata={"help": text}, **kw)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass
class TrainConfig:
    """``whiteformer train``: train (or fine-tune) a model on a dataset."""

    # model
    model: str = _h("registered model name (whiteformer list-models)", default="tost_t12_p16")
    model_args: Dict[str, Any] = _h("constructor overrides, e.g. model_args.embed_dim=64", default_factory=dict)
    finetune: Optional[str] = _h("checkpoint to start from (own dir, official ToST .pth, timm); the head "
                                 "is reset when the number of classes differs", default=None)
    # data
    dataset: str = _h("dataset name (digits, mnist, image-folder, subspaces, text, listops)", default="digits")
    data_dir: Optional[str] = _h("data directory (mnist, image-folder) or text file (text)", default=None)
    data_args: Dict[str, Any] = _h("dataset options, e.g. data_args.img_size=16", default_factory=dict)
    eval_split: str = _h("split used for evaluation", default="test")
    translate: int = _h("augmentation: random translation in pixels (0: off; image datasets)", default=1)
    flip: float = _h("augmentation: horizontal-flip probability", default=0.0)
    block_size: int = _h("language models: context length of the training windows", default=128)
    # optimisation
    epochs: int = _h("training epochs (image / sequence datasets)", default=30)
    steps: int = _h("total optimizer steps; > 0 overrides epochs (required for text)", default=0)
    batch_size: int = _h("global batch size (split over the DDP processes)", default=64)
    lr: float = _h("peak learning rate (AdamW)", default=1e-3)
    min_lr: float = _h("final learning rate of the cosine schedule", default=1e-5)
    weight_decay: float = _h("AdamW weight decay (not on biases, norms, no_weight_decay())", default=0.05)
    beta1: float = _h("AdamW beta1", default=0.9)
    beta2: float = _h("AdamW beta2", default=0.999)
    warmup_steps: int = _h("linear warm-up steps (overrides warmup_epochs when > 0)", default=0)
    warmup_epochs: float = _h("linear warm-up length in epochs", default=0.0)
    label_smoothing: float = _h("label smoothing of the cross-entropy (classification)", default=0.0)
    clip_grad: float = _h("gradient-norm clipping (0: off)", default=1.0)
    ema: bool = _h("keep an exponential moving average of the weights (used for evaluation)", default=False)
    ema_decay: float = _h("EMA decay per step", default=0.999)
    bf16: bool = _h("bfloat16 autocast for forward/backward", default=False)
    compile: bool = _h("torch.compile the model", default=False)
    # run
    seed: int = _h("random seed (model init, data order, augmentation)", default=0)
    device: str = _h("device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...", default="auto")
    num_threads: int = _h("torch CPU threads (0: torch default)", default=0)
    deterministic: bool = _h("torch.use_deterministic_algorithms(True)", default=False)
    out: str = _h("run directory (config, logs, checkpoints, report)", default="runs/train")
    overwrite: bool = _h("start afresh in an existing run directory (deletes its checkpoints)", default=False)
    resume: bool = _h("continue from the newest valid checkpoint in the run directory", default=False)
    ckpt_every: int = _h("checkpoint every k steps (0: at the end of every epoch)", default=0)
    keep_last: int = _h("checkpoints to keep", default=3)
    eval_every: int = _h("evaluate every k steps (0: every epoch; LM: 10 times per run)", default=0)
    eval_batches: int = _h("language models: validation windows = eval_batches x batch_size", default=10)
    log_every: int = _h("log training metrics every k steps", default=10)
    progress: bool = _h("tqdm progress bars", default=True)
    tensorboard: bool = _h("also log to TensorBoard when it is installed", default=True)
    report: bool = _h("write the run report (markdown + PNGs) at the end", default=True)
    report_images: int = _h("test images shown in the membership maps", default=4)
    throttle: float = _h("sleep seconds after each step (fault-injection tests)", default=0.0)

    def validate(self) -> None:
        _check(bool(self.model), "model must be a registered model name (whiteformer list-models)")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.epochs >= 1 or self.steps >= 1, "give epochs >= 1 or steps >= 1")
        _check(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        _check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _check(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1 and beta2 must be in [0, 1)")
        _check(self.warmup_steps >= 0 and self.warmup_epochs >= 0, "warm-up lengths must be >= 0")
        _check(0 <= self.label_smoothing < 1, f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        _check(self.clip_grad >= 0, f"clip_grad must be >= 0 (0: off), got {self.clip_grad}")
        _check(0 < self.ema_decay < 1, f"ema_decay must be in (0, 1), got {self.ema_decay}")
        _check(self.translate >= 0, f"translate must be >= 0 pixels, got {self.translate}")
        _check(0 <= self.flip <= 1, f"flip must be a probability in [0, 1], got {self.flip}")
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(self.ckpt_every >= 0 and self.eval_every >= 0 and self.log_every >= 1,
               "ckpt_every and eval_every must be >= 0, log_every >= 1")
        _check(self.keep_last >= 1, f"keep_last must be >= 1, got {self.keep_last}")
        _check(self.eval_batches >= 1, f"eval_batches must be >= 1, got {self.eval_batches}")
        _check(self.num_threads >= 0, f"num_threads must be >= 0, got {self.num_threads}")
        _check(self.throttle >= 0, f"throttle must be >= 0, got {self.throttle}")
        _check(not (self.resume and self.overwrite), "resume and overwrite exclude each other: pick one")
        _check(not (self.resume and self.finetune), "resume continues a run; finetune starts a new one: pick one")


@dataclass
class EvalConfig:
    """``whiteformer eval``: accuracy / loss of a checkpoint on a dataset split."""

    checkpoint: str = _h("run directory, its final/ or a checkpoint dir (own format), or a foreign file", default="")
    model: Optional[str] = _h("model name (needed for foreign checkpoint files)", default=None)
    model_args: Dict[str, Any] = _h("constructor overrides (foreign checkpoints)", default_factory=dict)
    dataset: Optional[str] = _h("dataset (default: the one the run was trained on)", default=None)
    data_dir: Optional[str] = _h("data directory / text file", default=None)
    data_args: Dict[str, Any] = _h("dataset options (default: the run's)", default_factory=dict)
    split: str = _h("split to evaluate", default="test")
    batch_size: int = _h("batch size", default=256)
    block_size: int = _h("language models: window length (default: the run's)", default=0)
    eval_batches: int = _h("language models: number of batches", default=10)
    ema: bool = _h("use the EMA weights of a run when present", default=True)
    device: str = _h("device (auto: cuda if available)", default="auto")
    json: bool = _h("print the result as JSON", default=False)

    def validate(self) -> None:
        _check(bool(self.checkpoint), "give --checkpoint (a run directory or a checkpoint)")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")


@dataclass
class GenerateConfig:
    """``whiteformer generate``: sample text from a language-model checkpoint."""

    checkpoint: str = _h("run directory or its final/ (with vocab.json)", default="")
    prompt: str = _h("text to continue", default="\n")
    max_new_tokens: int = _h("characters to generate", default=300)
    temperature: float = _h("sampling temperature (0: greedy)", default=0.8)
    top_k: int = _h("top-k filter (0: off)", default=0)
    num_samples: int = _h("independent samples", default=1)
    seed: int = _h("sampling seed", default=0)
    device: str = _h("device (auto: cuda if available)", default="auto")

    def validate(self) -> None:
        _check(bool(self.checkpoint), "give --checkpoint (a language-model run directory)")
        _check(self.max_new_tokens >= 0, "max_new_tokens must be >= 0")
        _check(self.temperature >= 0, "temperature must be >= 0")
        _check(self.top_k >= 0, "top_k must be >= 0 (0: off)")
        _check(self.num_samples >= 1, "num_samples must be >= 1")


@dataclass
class AnalyzeConfig:
    """``whiteformer analyze <analysis>``: white-box analyses (``eca-toy``, ``report``)."""

    out: str = _h("output directory", default="runs/analysis")
    seed: int = _h("random seed", default=0)
    small: bool = _h("reduced problem size (quick check)", default=False)
    plots: bool = _h("write PNG figures (needs matplotlib)", default=True)
    checkpoint: Optional[str] = _h("run directory (analysis 'report')", default=None)
    options: Dict[str, Any] = _h("analysis-specific options, e.g. options.layers=6", default_factory=dict)
