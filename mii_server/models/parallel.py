"""The tensor-parallel group a model is built for: rank, size and the collectives layers need."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """Rank ``rank`` of ``size`` ranks that together hold one copy of the model.

    With size 1 every collective is the identity, so single-rank code pays nothing.
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def split(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``total`` items; ``total`` must divide."""
        if total % self.size:
            raise ValueError(f"{total} does not divide over {self.size} tensor-parallel ranks")
        share = total // self.size
        return self.rank * share, share
