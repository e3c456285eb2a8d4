"""Data-parallel training support (``torchrun --nproc_per_node=N -m whiteformer train ...``).

- :func:`setup`: reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), initialises
  the process group (``nccl`` on CUDA, ``gloo`` on CPU) and picks the device. With context
  parallelism ``R`` (``--context-parallel R``) the ranks form ``WORLD_SIZE / R`` groups of ``R``
  consecutive ranks; each group shares a slice of the batch and splits its sequences (group rank
  order = sequence order), the groups are data-parallel.
- :func:`shard_model`: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every block and on the
  root, with a mixed-precision policy (``whiteformer train --fsdp``): parameters, gradients and
  optimizer state are split over the processes instead of replicated (DDP).
- :func:`convert_sync_batchnorm`: BatchNorm layers (the conv patch embedding of the ToST shell) must
  see the statistics of the *global* batch for data-parallel training to equal one process with the
  same global batch. On CUDA this is ``torch.nn.SyncBatchNorm``; torch's SyncBatchNorm does not run
  on CPU, so there :class:`CPUSyncBatchNorm` all-reduces the batch moments itself (autograd-aware).
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist
import torch.nn as nn

from ...ops.context_parallel import all_reduce_sum as context_all_reduce_sum
from ..config import ConfigError

__all__ = ["DistInfo", "setup", "shard_model", "cleanup", "resolve_device", "convert_sync_batchnorm",
           "CPUSyncBatchNorm", "all_reduce_sum", "all_gather_object", "barrier"]


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    cp_size: int = 1  # processes per context-parallel group (1: none)
    cp_group: Any = None  # this rank's context-parallel process group

    @property
    def cp_rank(self) -> int:
        """Position of this rank's chunk in the sequence."""
        return self.rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        """Which data-parallel slice of the batch this rank's group reads."""
        return self.rank // self.cp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """"auto" -> cuda (the local rank's GPU) if available, else cpu; otherwise ``torch.device(spec)``.
    A device name torch does not know, CUDA where there is none, or another device this process cannot
    compute on (``meta``, ``mps`` / ``xpu`` / ... without their backend) is a :class:`ConfigError`."""
    from ..config import ConfigError, check_device

    if spec in ("auto", "", None):
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = check_device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {spec!r} requested but CUDA is not available; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    elif device.type != "cpu":
        try:  # one small computation, read back: what every command does with its device
            (torch.ones(1, device=device) + 1).cpu()
        except Exception as err:  # noqa: BLE001 - each backend fails its own way (NotImplementedError, ...)
            raise ConfigError(f"device {spec!r} cannot compute in this process ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else '-'}); use --device cpu") from None
    return device


def setup(device: str = "auto", context_parallel: int = 1) -> DistInfo:
    """Initialise distributed training when launched by torchrun (WORLD_SIZE > 1), with
    ``context_parallel`` consecutive ranks per context-parallel group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if context_parallel > 1 and world % context_parallel:
        raise ValueError(f"--context-parallel {context_parallel} needs a number of processes divisible by it, got "
                         f"WORLD_SIZE={world} (launch with torchrun --nproc_per_node=R*D)")
    dev = resolve_device(device, local)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    cp_group = None
    if context_parallel > 1:
        for first in range(0, world, context_parallel):  # every rank creates every group
            group = dist.new_group(list(range(first, first + context_parallel)))
            if first <= rank < first + context_parallel:
                cp_group = group
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=dev, cp_size=context_parallel,
                    cp_group=cp_group)


def shard_model(model: nn.Module, precision: str = "fp32") -> nn.Module:
    """FSDP2 in place: ``fully_shard`` each block (``transformer.h`` of the language models,
    ``blocks`` / ``cls_attn_blocks`` of the others), then the root (embeddings, norms, head). Under
    ``precision`` bf16 / fp16 the blocks compute in that dtype (``MixedPrecisionPolicy.param_dtype``)
    and gradients are reduced in float32. A model with 0-dim parameters (ECAttention's strengths
    ``alpha_raw`` / ``beta_raw``), which FSDP2 cannot shard, raises :class:`ConfigError`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ConfigError(f"--fsdp cannot shard {type(model).__name__}: FSDP2 shards no 0-dim parameters "
                          f"({', '.join(scalars[:3])}{', ...' if len(scalars) > 3 else ''}); train it without --fsdp "
                          "(data-parallel, DDP)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    transformer = getattr(model, "transformer", None)
    groups = [getattr(transformer, "h", None), getattr(model, "blocks", None), getattr(model, "cls_attn_blocks", None)]
    for blocks in groups:
        for blk in (blocks if isinstance(blocks, (nn.ModuleList, nn.Sequential)) else ()):
            fully_shard(blk, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def cleanup() -> None:
    """Destroy the process groups, after a garbage collection: what still refers to them (FSDP's hook
    cycles, autograd graphs, the tracebacks of caught errors) would otherwise be freed in interpreter
    shutdown, after the groups, where a gloo rank aborts now and then (SIGABRT, "terminate called
    without an active exception"). Drop your own references (model, trainer) before calling it."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over processes (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj: Any) -> List[Any]:
    if dist.is_available() and dist.is_initialized():
        out: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def differentiable_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over all processes; the gradient of every process's input is the sum over processes of
    the output gradients (each process's loss depends on every input)."""
    return context_all_reduce_sum(x, None)


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch of all processes, for any device (gloo on CPU).

    Training: the per-channel sums of x and of (x - mean)^2 are all-reduced with
    a differentiable all-reduce (so gradients flow through the statistics as in single-process
    BatchNorm); running statistics are updated as ``nn.BatchNorm`` does (unbiased
    variance). Evaluation uses the running statistics (no communication). Same parameter and buffer
    names as ``nn.BatchNorm2d``.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch = self.training or not self.track_running_stats
        if not use_batch or not (dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        all_reduce = differentiable_all_reduce
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()
        count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float32, device=x.device)
        s = all_reduce(torch.cat([xf.sum(dims), count]))
        n = s[-1]
        mean = s[:-1] / n
        shape = [1, -1] + [1] * (x.dim() - 2)
        centred = xf - mean.reshape(shape)
        var = all_reduce((centred * centred).sum(dims)) / n
        y = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (n / torch.clamp(n - 1, min=1.0))
                self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        return y.to(x.dtype)


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm by a synchronised one (``nn.SyncBatchNorm`` on CUDA,
    :class:`CPUSyncBatchNorm` elsewhere), keeping parameters and buffers."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _convert_cpu(module)


def _convert_cpu(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        out = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats, device=_dev(module), dtype=_dtype(module))
        with torch.no_grad():
            if module.affine:
                out.weight.copy_(module.weight)
                out.bias.copy_(module.bias)
            if module.track_running_stats:
                out.running_mean.copy_(module.running_mean)
                out.running_var.copy_(module.running_var)
                out.num_batches_tracked.copy_(module.num_batches_tracked)
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child))
    return out


def _dev(m: nn.Module):
    for t in list(m.parameters()) + list(m.buffers()):
        return t.device
    return None


def _dtype(m: nn.Module):
    for t in m.parameters():
        return t.dtype
    return None

