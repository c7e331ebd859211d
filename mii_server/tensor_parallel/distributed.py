"""torch.distributed set-up for one replica's tensor-parallel ranks."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from ..models.parallel import TensorParallelGroup


def init_tensor_parallel(
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    init_method: str | None = None,
    store: dist.Store | None = None,
    timeout_s: float = 600.0,
) -> TensorParallelGroup:
    """Join the replica's process group: NCCL on CUDA, gloo on the CPU, chosen from ``device``.

    Rendezvous through ``store`` (a TCPStore rank 0 opened on a port the OS picked, so replicas and
    deployments never collide) or ``init_method`` (``env://`` under torchrun).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TensorParallelGroup(rank=rank, size=world_size, device=str(device))


def open_store(host: str, rank: int, world_size: int, port: int = 0, timeout_s: float = 600.0) -> dist.TCPStore:
    """Rank 0 opens the rendezvous store (port 0: the OS picks a free one, read back from ``.port``);
    the other ranks connect to rank 0's port.

    why rank 0 binds the socket itself: torch's TCPStore listens on every interface whatever host it
    is given; a socket bound to ``host`` and handed over (the store then owns it) keeps the store on
    the address the deployment promised (loopback by default).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, port))
        listener.listen(max(16, world_size))
    except OSError:
        listener.close()
        raise
    bound = listener.getsockname()[1]
    return dist.TCPStore(
        host, bound, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
        master_listen_fd=listener.detach(), use_libuv=False,  # libuv's backend cannot take a socket
    )  # fmt: skip


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
