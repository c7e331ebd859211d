"""Rank 0's executor (publish, then run) and the followers' loop (receive, then run)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..batching.executor import run_step
from ..batching.step import Step
from ..engine import InferenceEngine
from .channel import StepPublisher, StepSubscriber

log = logging.getLogger(__name__)

# Rank 0 sends an empty Step at least this often while idle; followers give up after the timeout.
HEARTBEAT_S = 2.0
FOLLOWER_TIMEOUT_S = 60.0


class BroadcastExecutor:
    """Rank 0 of T: every Step goes to the followers first, then runs here; collectives inside the
    forward keep the ranks in lock step. Only rank 0 samples, so Steps carry every token id."""

    feeds_back = False

    def __init__(self, engine: InferenceEngine, publisher: StepPublisher) -> None:
        self.engine = engine
        self.publisher = publisher

    def execute(self, step: Step) -> torch.Tensor | None:
        self.publisher.publish(step)
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


def follow(engine: InferenceEngine, subscriber: StepSubscriber, timeout_s: float = FOLLOWER_TIMEOUT_S) -> Step:
    """Run every Step rank 0 publishes until one says stop; returns that stop Step. Raises EngineDead
    when rank 0 goes silent."""
    while True:
        step = subscriber.receive(timeout_s)
        if step.stop:
            return step
        run_step(engine, step)
