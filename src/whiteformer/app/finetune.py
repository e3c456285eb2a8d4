"""Data and fine-tuning of a compressed model (IrrAtt paper, Sec. 3.3 / Table 1's fine-tuned rows), the
library side of ``whiteformer compress``: :func:`build_image_task` (a dataset's task, images resized
to the model) and :func:`finetune_compressed` (the shared training step of :mod:`whiteformer.app.train.loop`
with the head-fusion projection as its post-step hook)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

__all__ = ["build_image_task", "finetune_compressed"]


def build_image_task(model: nn.Module, data: str, data_dir: Optional[str] = None, batch_size: int = 64,
                     seed: int = 0, device=None):
    """The training task of the registered dataset ``data`` (:func:`whiteformer.app.train.build.build_task`),
    images resized to the model's ``img_size``; a clear error when the model cannot read the data
    (other kind of data, channels or classes)."""
    from ..compress.latency import image_input_shape
    from .data import dataset_info
    from .train.build import build_task
    from .train.distributed import DistInfo

    _, h, w = image_input_shape(model)
    data_args = {"img_size": h if h == w else (h, w)} if "img_size" in dataset_info(data)["arguments"] else {}
    dist = DistInfo(device=torch.device(device) if device is not None else next(model.parameters()).device)
    task = build_task(data, data_dir=data_dir, data_args=data_args, batch_size=batch_size, seed=seed, dist=dist)
    type(task).check_model(model, task.train_ds)
    return task


def finetune_compressed(model: nn.Module, task, *, epochs: int = 1, lr: float = 1e-4, weight_decay: float = 0.05,
             fusion_constraints: bool = False, max_steps: Optional[int] = None,
             log: Optional[Callable[[str], None]] = None) -> dict:
    """Fine-tune a compressed ``model`` in place on ``task`` with :func:`whiteformer.app.train.loop.finetune`
    (AdamW without decay on biases, norms and fusion matrices; constant LR). With
    ``fusion_constraints`` the fusion matrices are projected onto ``{S >= 0, S S^T = I}`` before
    training and after every step (IrrAtt paper, Sec. 3.3, Eq. 7).

    Returns ``{"dataset", "epochs", "steps", "train_loss" (last epoch), "acc_before", "acc_after",
    "loss_before", "loss_after", "fusion_constraints", "time_s"}``.
    """
    from ..compress.constraints import apply_fusion_constraints
    from .train.loop import finetune as run_finetune

    if fusion_constraints and apply_fusion_constraints(model) == 0:
        raise ValueError("fusion_constraints: the model has no head-fusion matrix (compress with qk='irratt' and "
                         "fusion='general', or qk='cp')")
    before = task.evaluate(model)
    res = run_finetune(model, task, epochs=epochs, lr=lr, weight_decay=weight_decay, max_steps=max_steps,
                       post_step=[apply_fusion_constraints] if fusion_constraints else [],
                       no_decay=lambda name: name.endswith("fusion"), log=log)
    after = task.evaluate(model)
    if log is not None:
        log(f"fine-tune: test accuracy {100 * before['acc']:.2f} % -> {100 * after['acc']:.2f} %")
    return {"dataset": task.train_ds.name, "epochs": epochs, "steps": res["steps"], "train_loss": res["train_loss"],
            "acc_before": before["acc"], "acc_after": after["acc"], "loss_before": before["loss"],
            "loss_after": after["loss"], "fusion_constraints": bool(fusion_constraints), "time_s": res["time_s"]}
