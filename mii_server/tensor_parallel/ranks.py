"""Start one tensor-parallel rank: join the process group, load this rank's shard, open the channel."""

from __future__ import annotations

from dataclasses import dataclass

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
    init_method: str  # torch.distributed rendezvous: tcp://host:port, or env:// under torchrun
    channel_host: str  # address rank 0's step publisher binds (loopback unless multi-host)
    channel_port: int  # its port
    device: torch.device  # this rank's GPU, or the CPU


@dataclass
class StartedRank:
    runtime: Runtime
    executor: BroadcastExecutor | None  # rank 0
    subscriber: StepSubscriber | None  # ranks 1..T-1


def start_rank(config: ModelConfig, placement: RankPlacement) -> StartedRank:
    tp = init_tensor_parallel(placement.rank, placement.world_size, placement.init_method, placement.device)
    if placement.rank == 0:
        publisher = StepPublisher(placement.channel_host, placement.channel_port)
        runtime = build_runtime(config, tp, placement.device)
        publisher.wait_for_subscribers(placement.world_size - 1, SUBSCRIBE_TIMEOUT_S)
        return StartedRank(runtime, BroadcastExecutor(runtime.engine, publisher), None)
    subscriber = StepSubscriber(placement.channel_host, placement.channel_port)
    return StartedRank(build_runtime(config, tp, placement.device), None, subscriber)
