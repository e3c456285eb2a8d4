"""Repeated augmentation: each image several times per epoch, its copies on different processes.

Repeated augmentation (Hoffer et al.: "Augment your batch: better training with larger batches",
arXiv:1901.09335; Berman et al.: "Multigrain", arXiv:1902.05509), as DeiT's ``RASampler``
(Touvron et al.: "Training data-efficient image transformers & distillation through attention",
arXiv:2012.12877): an epoch's permutation is repeated element-wise ``repeats`` times
(``[a, a, a, b, b, b, ...]``), wrapped to a multiple of the number of processes, and process ``r``
reads every ``num_replicas``-th index from ``r``: the copies of an image land on consecutive
processes, each augmented differently. An epoch still holds ``len(dataset)`` samples in all
(``len(dataset) // num_replicas`` per process), so it sees about ``1 / repeats`` of the images.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from ..._checks import check_int

__all__ = ["repeated_indices", "RepeatAugSampler"]


def repeated_indices(n: int, repeats: int, num_replicas: int, generator: torch.Generator) -> torch.Tensor:
    """(num_replicas, ceil(n * repeats / num_replicas)) indices in [0, n): row r is process r's stream."""
    perm = torch.randperm(n, generator=generator).repeat_interleave(repeats)
    per_rank = math.ceil(n * repeats / num_replicas)
    total = per_rank * num_replicas
    perm = torch.cat([perm, perm[:total - len(perm)]])
    return perm.view(per_rank, num_replicas).t().contiguous()


class RepeatAugSampler(torch.utils.data.Sampler):
    """``torch.utils.data.Sampler`` of process ``rank``'s indices (``len(dataset) // num_replicas``
    per epoch); ``set_epoch(e)`` reshuffles with the seed ``(seed, e)``, as ``DistributedSampler``."""

    def __init__(self, dataset, num_replicas: int = 1, rank: int = 0, repeats: int = 3, seed: int = 0):
        self.n = len(dataset)
        self.num_replicas = check_int(num_replicas, "num_replicas", 1)
        self.rank = check_int(rank, "rank", 0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={self.num_replicas}), got {rank!r}")
        self.repeats = check_int(repeats, "repeats", 1)
        self.seed, self.epoch = int(seed), 0
        if self.n < self.num_replicas:
            raise ValueError(f"the dataset ({self.n} samples) has fewer samples than processes ({self.num_replicas})")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(repeated_indices(self.n, self.repeats, self.num_replicas, g)[self.rank, :len(self)].tolist())
