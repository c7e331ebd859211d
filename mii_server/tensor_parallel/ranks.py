"""Start one tensor-parallel rank: join the process group, load this rank's shard, open the channel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..runtime import Runtime, build_runtime
from .channel import StepPublisher, StepSubscriber
from .distributed import init_tensor_parallel
from .executor import BroadcastExecutor

SUBSCRIBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank of a replica runs and how it finds the others."""

    rank: int  # 0 schedules and samples; 1..T-1 follow
    world_size: int  # T, the replica's tensor-parallel degree
    device: torch.device  # this rank's GPU, or the CPU
    channel_host: str  # address rank 0's step publisher binds (loopback unless multi-host)
    channel_port: int  # its port (0 on rank 0: the OS picks one, see StepPublisher.port)
    init_method: str | None = None  # torch.distributed rendezvous by URL (env:// under torchrun) ...
    store: Any = None  # ... or through an open torch.distributed store


@dataclass
class StartedRank:
    runtime: Runtime
    executor: BroadcastExecutor | None  # rank 0
    subscriber: StepSubscriber | None  # ranks 1..T-1


def start_rank(
    config: ModelConfig, placement: RankPlacement, publisher: StepPublisher | None = None
) -> StartedRank:
    """Join the group, load this rank's shard and open its end of the step channel. Rank 0 may
    bring an already bound ``publisher`` (whose port it told the followers)."""
    tp = init_tensor_parallel(
        placement.rank, placement.world_size, placement.device,
        init_method=placement.init_method, store=placement.store,
    )
    if placement.rank == 0:
        publisher = publisher or StepPublisher(placement.channel_host, placement.channel_port)
        runtime = build_runtime(config, tp, placement.device)
        publisher.wait_for_subscribers(placement.world_size - 1, SUBSCRIBE_TIMEOUT_S)
        return StartedRank(runtime, BroadcastExecutor(runtime.engine, publisher, tp), None)
    subscriber = StepSubscriber(placement.channel_host, placement.channel_port)
    return StartedRank(build_runtime(config, tp, placement.device), None, subscriber)
