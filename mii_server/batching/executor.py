"""Executors run a Step on the engine: flush, then one ragged forward."""

from __future__ import annotations

from typing import Protocol

import torch

from ..engine import InferenceEngine
from .step import Step


class StepExecutor(Protocol):
    engine: InferenceEngine
    # whether a Step may carry fed-back placeholder tokens (every rank must hold the sampled ids)
    feeds_back: bool

    def execute(self, step: Step) -> torch.Tensor | None:
        """Apply ``step`` (on every rank); rank 0 gets the logits of its sequences, or None."""
        ...

    def idle(self) -> None:
        """Called while no work is queued, at least every few seconds (tensor-parallel heartbeat)."""
        ...

    def close(self) -> None: ...


class LocalExecutor:
    """One rank holds the whole model: execute in this process."""

    feeds_back = True

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def execute(self, step: Step) -> torch.Tensor | None:
        return run_step(self.engine, step)

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_step(engine: InferenceEngine, step: Step) -> torch.Tensor | None:
    for uid in step.flush_uids:
        engine.flush(uid)
    if not step.uids:
        return None
    with torch.inference_mode():
        return engine.put(step.uids, step.tokens)
