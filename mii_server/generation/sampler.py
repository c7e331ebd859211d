"""Token selection for a batch of rows, each with its own parameters and random generator.

Everything stays on the logits' device until the chosen ids are copied back once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SamplingRow:
    """How to pick the next token for one sequence."""

    greedy: bool  # argmax; the fields below are then ignored
    temperature: float  # divides logits (1.0 = unchanged)
    top_k: int | None  # keep the k most likely tokens
    top_p: float  # keep the smallest set whose probability reaches top_p (1.0 = all)
    generator: torch.Generator | None  # the request's own stream (seeded), on the logits' device
    banned_ids: Sequence[int] = ()  # ids that must not be picked now (EOS before min_new_tokens)


def filter_probs(probs: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Zero every token outside the top-k and the top-p nucleus. probs: [V] -> [V] (unnormalised)."""
    if top_k is None and top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k is not None:
        keep[top_k:] = False
    if top_p < 1.0:
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep &= mass_before < top_p
    keep[0] = True  # the most likely token always survives
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """logits: float32 [S, V] -> one token id per row."""
    logits = logits.float()
    for i, row in enumerate(rows):
        if row.banned_ids:
            logits[i, list(row.banned_ids)] = float("-inf")
    chosen = logits.argmax(dim=-1)  # [S]: right for greedy rows, overwritten for sampled ones
    for i, row in enumerate(rows):
        if row.greedy:
            continue
        probs = torch.softmax(logits[i] / row.temperature, dim=-1)
        probs = filter_probs(probs, row.top_k, row.top_p)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and never picks p == 0.
        race = torch.empty_like(probs).exponential_(generator=row.generator)
        chosen[i] = (probs / race).argmax()
    return chosen.tolist()
