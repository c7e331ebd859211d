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
    device: str = "cpu"  # where collective buffers live (NCCL needs CUDA tensors)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast_from_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite ``x`` on every rank with rank 0's, in place (on the device with NCCL: no rank
        waits on the host)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. KV blocks, so every rank holds the same count)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def split(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``total`` items; ``total`` must divide."""
        if total % self.size:
            raise ValueError(f"{total} does not divide over {self.size} tensor-parallel ranks")
        share = total // self.size
        return self.rank * share, share
