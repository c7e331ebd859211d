"""torch.distributed set-up for one replica's tensor-parallel ranks."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..models.parallel import TensorParallelGroup


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float = 600.0
) -> TensorParallelGroup:
    """Join the replica's process group: NCCL on CUDA, gloo on the CPU, chosen from ``device``.

    ``init_method``: ``tcp://host:port`` (a port allocated per replica) or ``env://`` under torchrun.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TensorParallelGroup(rank=rank, size=world_size, device=str(device))


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when started by torchrun (or another launcher setting the
    usual variables), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ.get("LOCAL_RANK", rank)), int(os.environ["WORLD_SIZE"])


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
