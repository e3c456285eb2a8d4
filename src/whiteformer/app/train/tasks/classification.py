"""Image / vector classification with cross-entropy (label smoothing).

Epoch ``e`` visits the training set in the order ``randperm(N, seed=(seed, e))``, in full global
batches (the incomplete last one is dropped); augmentation parameters of step ``s`` come from a
generator seeded with ``(seed, s)``.

Images may get the DeiT / XCiT / ToST recipe (:class:`~whiteformer.app.data.recipe.VisionRecipe`),
in this order: random resized crop, translation / flip, RandAugment (on [0, 1] images), normalisation, random erasing,
Mixup / CutMix (soft targets, trained with the soft-target cross-entropy). With ``aug_repeats`` k > 1
the epoch's order is DeiT's repeated-augmentation order over the data-parallel processes
(:func:`~whiteformer.app.data.sampler.repeated_indices`), a function of ``(seed, e)`` and their number.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...config import ConfigError
from ...data.augment import Augment
from ...data.mixing import soft_target_cross_entropy
from ...data.recipe import VisionRecipe
from ...data.sampler import repeated_indices
from ..distributed import DistInfo, all_reduce_sum
from .base import ReportContext, Task, seeded_generator

__all__ = ["ClassificationTask", "ImageClassificationTask", "VectorClassificationTask"]


class ClassificationTask(Task):
    """Cross-entropy classification of whatever ``ds.get_batch`` yields (the base of the image,
    vector and token-sequence classification tasks)."""

    kind = "classification"
    #: the inputs are images that ``translate`` / ``flip`` augmentation applies to
    augments = False
    options = Task.options + ("label_smoothing", "augment", "eval_batch_size", "translate", "flip", "recipe")

    def __init__(self, train_ds, eval_ds, batch_size: int = 64, seed: int = 0, dist: Optional[DistInfo] = None,
                 bf16: bool = False, label_smoothing: float = 0.0, augment: Optional[Augment] = None,
                 eval_batch_size: int = 256, translate: int = 0, flip: float = 0.0,
                 recipe: Optional[VisionRecipe] = None):
        super().__init__(train_ds, eval_ds, batch_size, seed, dist, bf16)
        self.label_smoothing = label_smoothing
        self._setup_recipe(recipe or VisionRecipe(label_smoothing=label_smoothing))
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

    @classmethod
    def from_options(cls, train_ds, eval_ds, dist: Optional[DistInfo] = None, **options: Any) -> "ClassificationTask":
        recipe = options.pop("recipe", None) or VisionRecipe.from_options(options)
        cls._refuse_recipe(recipe, train_ds)
        return super().from_options(train_ds, eval_ds, dist, **options, recipe=recipe)

    @classmethod
    def _refuse_recipe(cls, recipe: VisionRecipe, ds) -> None:
        if recipe.active and not cls.augments:
            raise ConfigError(f"auto_augment, mixup, cutmix, reprob and aug_repeats augment images; dataset "
                              f"{ds.name!r} holds {getattr(ds, 'kind', 'other')} data: leave them off")

    def _setup_recipe(self, recipe: VisionRecipe) -> None:
        """The recipe's transforms (None when off) and the checks that need the data and the batch."""
        try:
            recipe.check()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self._refuse_recipe(recipe, self.train_ds)
        self.recipe = recipe
        self.resized_crop = self.rand_augment = self.mixup = self.erasing = None
        if not recipe.active:
            return
        ds = self.train_ds
        mean = ds.mean.expand(ds.in_chans).tolist()
        parts = recipe.build(ds.num_classes, mean, ds.img_size)
        self.resized_crop, self.rand_augment = parts["resized_crop"], parts["rand_augment"]
        self.mixup, self.erasing = parts["mixup"], parts["erasing"]
        if self.mixup is not None and recipe.impl == "timm" and self.local_batch % 2:
            raise ConfigError(f"timm's Mixup needs an even batch per process, got {self.local_batch} (batch_size "
                              f"{self.batch_size} over {self.dist.dp_size} process(es))")

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
        """The global order of epoch ``epoch``: global batch j is ``order[j B:(j + 1) B]``, process r
        reads its slice ``lo:hi`` of each."""
        if epoch != self._perm_epoch:
            g = seeded_generator(self.seed, 1, epoch)
            k = self.recipe.aug_repeats
            if k > 1:  # process r's stream laid out as its slices of the successive global batches
                per_rank = repeated_indices(len(self.train_ds), k, self.dist.dp_size, g)
                b, steps = self.local_batch, self.steps_per_epoch
                self._perm = per_rank[:, :steps * b].reshape(-1, steps, b).transpose(0, 1).reshape(-1)
            else:
                self._perm = torch.randperm(len(self.train_ds), generator=g)
            self._perm_epoch = epoch
        return self._perm  # type: ignore[return-value]

    def global_indices(self, step: int) -> torch.Tensor:
        epoch, j = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[j * self.batch_size:(j + 1) * self.batch_size]

    def train_batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = self.global_indices(step)[self.lo:self.hi]
        sl = slice(self.lo, self.hi)
        # (augmentation, stream of its seeded generator): each draws for the whole global batch.
        pre = [(a, s) for a, s in ((self.augment, 2), (self.rand_augment, 3)) if a is not None]
        params = [a.sample(self.batch_size, seeded_generator(self.seed, s, step)) for a, s in pre]

        def transform(x):
            for (a, _), p in zip(pre, params):
                x = a.apply(x, p, sl)
            return x

        kw = {}  # (only image datasets take crops)
        if self.resized_crop is not None:
            p = self.resized_crop.sample(self.batch_size, seeded_generator(self.seed, 6, step))
            kw["crop"] = (self.resized_crop, {k: v[sl] for k, v in p.items()})
        x, y = self.train_ds.get_batch(idx, transform if pre else None, **kw)
        if self.erasing is not None:
            x = self.erasing.apply(x, self.erasing.sample(self.batch_size, seeded_generator(self.seed, 4, step)), sl)
        if self.mixup is not None:
            x, y = self.mixup.apply(x, y, self.mixup.sample(self.batch_size, seeded_generator(self.seed, 5, step)), sl)
        return self._to(x, y)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        with self.autocast():
            logits = self.logits(model, x)
        if y.is_floating_point():  # soft targets (Mixup / CutMix, smoothing included): (B, K)
            loss = soft_target_cross_entropy(logits, y)
            y = y.argmax(-1)
        else:
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
        for i in self.eval_steps(range(0, len(idx_all), self.eval_batch_size)):
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
    model_kinds = ("image classifier",)
    kind_hint = "; the dataset holds images: use an image classifier (tost_*, dmst_*, eca_*, deit_*, crate_*)"

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
