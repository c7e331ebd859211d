"""Rank 0's executor (publish, then run) and the followers' loop (receive, then run)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..batching.executor import run_step
from ..batching.step import Step
from ..engine import InferenceEngine
from ..models.parallel import TensorParallelGroup
from .channel import StepPublisher, StepSubscriber

log = logging.getLogger(__name__)

# Rank 0 sends an empty Step at least this often while idle; followers give up after the timeout.
HEARTBEAT_S = 2.0
FOLLOWER_TIMEOUT_S = 60.0


def share_fed_back(engine: InferenceEngine, tp: TensorParallelGroup, step: Step) -> None:
    """Before ``step`` runs, every rank's fed-back ids become rank 0's, as many as its placeholders
    name. Only rank 0 samples; it fed the ids back on its device, so the followers receive them by a
    broadcast on theirs, and no rank waits for the host to read them back (overlap scheduling). Every
    rank reads the count from the same Step, so the broadcasts pair up."""
    count = step.fed_back_count
    if count:
        tp.broadcast_from_rank0(engine.fed_back_ids(count))


class BroadcastExecutor:
    """Rank 0 of T: every Step goes to the followers first, then runs here; collectives inside the
    forward keep the ranks in lock step. Only rank 0 samples; a Step's placeholder tokens are filled
    on every rank from rank 0's sampled ids (``share_fed_back``)."""

    def __init__(self, engine: InferenceEngine, publisher: StepPublisher, tp: TensorParallelGroup) -> None:
        self.engine = engine
        self.publisher = publisher
        self.tp = tp

    def execute(self, step: Step) -> torch.Tensor | None:
        self.publisher.publish(step)
        share_fed_back(self.engine, self.tp, step)
        return run_step(self.engine, step)

    def idle(self) -> None:
        self.publisher.publish(Step())

    def release_followers(self, responses: list[dict[str, Any]] | None = None) -> None:
        """Send the followers out of ``follow`` (end of a pipeline call, or shutdown), with the
        call's ``responses`` when every rank is to return them."""
        self.publisher.publish(Step(stop=True, responses=responses))

    def close(self) -> None:
        self.release_followers()
        self.publisher.close()


def follow(
    engine: InferenceEngine, subscriber: StepSubscriber, tp: TensorParallelGroup, timeout_s: float = FOLLOWER_TIMEOUT_S
) -> Step:
    """Run every Step rank 0 publishes until one says stop; returns that stop Step. Raises EngineDead
    when rank 0 goes silent."""
    while True:
        step = subscriber.receive(timeout_s)
        if step.stop:
            return step
        share_fed_back(engine, tp, step)
        run_step(engine, step)
