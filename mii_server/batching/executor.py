"""Executors run a Step on the engine: flush, then one ragged forward."""

from __future__ import annotations

from typing import Protocol

import torch

from ..engine import InferenceEngine
from .step import Step


class StepExecutor(Protocol):
    engine: InferenceEngine

    def execute(self, step: Step) -> torch.Tensor | None:
        """Apply ``step`` (on every rank); rank 0 gets the logits of its sequences, or None."""
        ...

    def idle(self) -> None:
        """Called while no work is queued, at least every few seconds (tensor-parallel heartbeat)."""
        ...

    def close(self) -> None: ...


class LocalExecutor:
    """One rank holds the whole model: execute in this process."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def execute(self, step: Step) -> torch.Tensor | None:
        return run_step(self.engine, step)

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_step(engine: InferenceEngine, step: Step) -> torch.Tensor | None:
    """Flush, start sequences from cached prefixes, run the forward, register the blocks it filled
    (this order on every rank: the scheduler counted blocks for it)."""
    for uid in step.flush_uids:
        engine.flush(uid)
    for uid, hashes in step.cached_prefix:
        engine.reuse_prefix(uid, hashes)
    if not step.uids:
        return None
    with torch.inference_mode():
        logits = engine.put(step.uids, step.tokens, step.full_logits)
    for uid, first, hashes in step.register:
        engine.register_blocks(uid, first, hashes)
    return logits
