"""Image / vector classification with cross-entropy (label smoothing).

Epoch ``e`` visits the training set in the order ``randperm(N, seed=(seed, e))``, in full global
batches (the incomplete last one is dropped); augmentation parameters of step ``s`` come from a
generator seeded with ``(seed, s)``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...config import ConfigError
from ...data.augment import Augment
from ..distributed import DistInfo, all_reduce_sum
from .base import ReportContext, Task, seeded_generator

__all__ = ["ClassificationTask", "ImageClassificationTask", "VectorClassificationTask"]


class ClassificationTask(Task):
    """Cross-entropy classification of whatever ``ds.get_batch`` yields (the base of the image,
    vector and token-sequence classification tasks)."""

    kind = "classification"
    #: the inputs are images that ``translate`` / ``flip`` augmentation applies to
    augments = False

    def __init__(self, train_ds, eval_ds, batch_size: int = 64, seed: int = 0, dist: Optional[DistInfo] = None,
                 bf16: bool = False, label_smoothing: float = 0.0, augment: Optional[Augment] = None,
                 eval_batch_size: int = 256, translate: int = 0, flip: float = 0.0):
        super().__init__(train_ds, eval_ds, batch_size, seed, dist, bf16)
        self.label_smoothing = label_smoothing
        if augment is None and (translate or flip):
            augment = Augment(translate=translate, flip=flip)
        self.augment = augment if (augment is not None and augment.active and self.augments) else None
        size = getattr(train_ds, "img_size", None)
        if self.augment is not None and size and self.augment.translate > min(size) // 2:
            raise ConfigError(f"translate ({self.augment.translate} pixels) must be at most half the images' "
                              f"smaller side ({min(size) // 2} for images {tuple(size)}): a larger shift moves "
                              f"most of the image out of the frame")
        self.eval_batch_size = eval_batch_size
        self._perm_epoch = -1
        self._perm: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ model for the data
    @classmethod
    def check_model(cls, model: nn.Module, ds) -> None:
        n_cls = getattr(model, "num_classes", ds.num_classes)
        if n_cls != ds.num_classes:
            raise ConfigError(f"the model has {n_cls} classes, dataset {ds.name!r} has {ds.num_classes}")

    # ------------------------------------------------------------------ training
    @property
    def steps_per_epoch(self) -> int:
        n = len(self.train_ds)
        if n < self.batch_size:
            raise ConfigError(f"batch_size {self.batch_size} is larger than the training set ({n} samples)")
        return n // self.batch_size

    def order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            self._perm = torch.randperm(len(self.train_ds), generator=seeded_generator(self.seed, 1, epoch))
            self._perm_epoch = epoch
        return self._perm  # type: ignore[return-value]

    def global_indices(self, step: int) -> torch.Tensor:
        epoch, j = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[j * self.batch_size:(j + 1) * self.batch_size]

    def train_batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = self.global_indices(step)[self.lo:self.hi]
        transform = None
        if self.augment is not None:
            params = self.augment.sample(self.batch_size, seeded_generator(self.seed, 2, step))
            sl = slice(self.lo, self.hi)
            transform = lambda x: self.augment.apply(x, params, sl)  # noqa: E731
        return self._to(*self.train_ds.get_batch(idx, transform))

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        with self.autocast():
            logits = self.logits(model, x)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
        with torch.no_grad():
            correct = (logits.argmax(-1) == y).sum()
        return loss, {"correct": correct.float(), "count": torch.tensor(float(y.numel()), device=y.device)}

    def train_metrics(self, totals: Dict[str, float]) -> Dict[str, float]:
        return {"train_acc": totals["correct"] / max(totals["count"], 1.0)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, ds=None) -> Dict[str, float]:
        """Mean cross-entropy (no smoothing) and accuracy on ``ds`` (default the eval split),
        sharded over the processes."""
        ds = ds if ds is not None else self.eval_ds
        was_training = model.training
        model.eval()
        dtype = next(model.parameters()).dtype
        idx_all = torch.arange(len(ds))[self.dist.rank::self.dist.world_size]
        tot = torch.zeros(3, dtype=torch.float64, device=self.device)
        for i in range(0, len(idx_all), self.eval_batch_size):
            x, y = self._to(*ds.get_batch(idx_all[i:i + self.eval_batch_size]))
            if x.is_floating_point():
                x = x.to(dtype)
            with self.autocast():
                logits = self.logits(model, x)
            tot[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
            tot[1] += (logits.argmax(-1) == y).sum().double()
            tot[2] += y.numel()
        all_reduce_sum(tot)
        model.train(was_training)
        n = max(tot[2].item(), 1.0)
        return {"loss": tot[0].item() / n, "acc": tot[1].item() / n, "n": int(tot[2].item())}

    # ------------------------------------------------------------------ reporting
    def summary(self, res: Dict[str, float]) -> str:
        return f"accuracy {100 * res['acc']:.2f} % (loss {res['loss']:.4f}, {res['n']} samples)"

    def report_rows(self, results: Dict[str, Any], split: str = "test") -> List[str]:
        final = results.get("final_eval", {})
        rows = [f"| **{split} accuracy** | **{100 * final.get('acc', float('nan')):.2f} %** "
                f"({final.get('n', '?')} samples) |",
                f"| {split} loss | {final.get('loss', float('nan')):.4f} |"]
        if results.get("ema_eval"):
            rows.append(f"| accuracy of the raw (non-EMA) weights | {100 * results['raw_eval']['acc']:.2f} % |")
        return rows

    def report_inputs(self, n: int = 64):
        return self.eval_ds.get_batch(torch.arange(min(n, len(self.eval_ds))))


class ImageClassificationTask(ClassificationTask):
    """Images (B, C, H, W) -> class: an image classifier built for the images' size, channels and
    classes, optional translate / flip augmentation; the report shows the membership maps of the
    first and last blocks."""

    augments = True

    @classmethod
    def model_kwargs(cls, ds, *, finetune=None, block_size=None):
        h, w = ds.img_size
        fixed: Dict[str, Any] = {"img_size": h if h == w else (h, w)}
        if finetune is None:
            fixed["num_classes"] = ds.num_classes
        return {"in_chans": ds.in_chans}, fixed

    @classmethod
    def adapt_model(cls, model: nn.Module, ds, finetune: Optional[str]) -> nn.Module:
        if finetune is not None and getattr(model, "num_classes", None) != ds.num_classes:
            if not hasattr(model, "reset_classifier"):
                raise ConfigError(f"model {type(model).__name__} has no reset_classifier(); cannot change its head "
                                  f"to {ds.num_classes} classes")
            model.reset_classifier(ds.num_classes)
        return model

    @classmethod
    def describe_data(cls, ds) -> str:
        return f"{ds.num_classes} classes, images {ds.img_size} with {ds.in_chans} channel(s)"

    @classmethod
    def model_hint(cls, message: str) -> str:
        if "in_chans" in message and "unknown argument" in message:
            return "; the dataset holds images: use an image classifier (tost_*, dmst_*, eca_*, deit_*, crate_*)"
        if "divisible by patch_size" in message:
            return ("; choose a patch size that divides the image size (model_args.patch_size=...) or resize the "
                    "images (data_args.img_size=...)")
        return ""

    @classmethod
    def check_model(cls, model: nn.Module, ds) -> None:
        if hasattr(model, "vocab_size"):
            raise ConfigError(f"dataset {ds.name!r} holds images, but the model ({type(model).__name__}) reads token "
                              f"sequences; evaluate it on the kind of data it was trained on")
        conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
        if conv is not None and conv.in_channels != ds.in_chans:
            raise ConfigError(f"dataset {ds.name!r} has {ds.in_chans} channel(s), the model takes {conv.in_channels}")
        super().check_model(model, ds)

    def report_sections(self, model: nn.Module, ctx: ReportContext) -> List[str]:
        from ....analysis.maps import cls_attention_maps, has_class_attention, has_memberships, membership_maps

        x = ctx.x
        if x is None or x.dim() != 4:
            return []
        k = min(ctx.num_images, x.shape[0])
        cls_lines: List[str] = []
        if ctx.plt is not None and has_class_attention(model):
            try:
                cls_attention_maps(model, x[:k], ctx.run_dir / "cls_attention.png")
                ctx.figures["cls_attention"] = "cls_attention.png"
                cls_lines = ["## [CLS] attention maps", "",
                             "Attention of the class token over the patches in the last class-attention block, per "
                             "head (ToST Fig. 5); each map scaled to its own range. Where the memberships are diffuse "
                             "these usually show more clearly which patches the prediction reads.", "",
                             "![cls attention](cls_attention.png)", ""]
            except Exception as err:  # noqa: BLE001 - an analysis must not fail the run
                ctx.notes.append(f"[CLS] attention maps skipped: {type(err).__name__}: {err}")
        if not has_memberships(model):
            ctx.notes.append("the attention does not return memberships (return_pi): no membership maps.")
            return cls_lines
        if ctx.plt is None:
            return cls_lines
        try:
            with torch.no_grad():
                preds = model(x[:k]).argmax(-1).cpu()
            membership_maps(model, x[:k], ctx.run_dir / "membership.png", blocks=[0, -1],
                            labels=ctx.labels[:k], preds=preds, max_images=None)
            ctx.figures["membership"] = "membership.png"
        except Exception as err:  # noqa: BLE001 - an analysis must not fail the run
            ctx.notes.append(f"membership maps skipped: {type(err).__name__}: {err}")
            return cls_lines
        return ["## Membership maps", "",
                "Memberships pi of each patch token to each head (the subspaces of the attention), over the patch "
                "grid, for the first and last blocks (numbered from 1).", "", "![membership](membership.png)",
                ""] + cls_lines


class VectorClassificationTask(ClassificationTask):
    """Vectors (B, D) -> class. No registered model reads plain vectors."""

    @classmethod
    def model_kwargs(cls, ds, *, finetune=None, block_size=None):
        raise ConfigError(f"dataset {ds.name!r} yields vector data, which the registered models do not take "
                          f"(they read images, characters or token sequences); for 'subspaces' use "
                          f"data_args.layout=image")
