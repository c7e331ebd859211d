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


def to_device(values: Sequence[int | float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor, copied without waiting for the device's queue (from
    pinned memory on CUDA: a copy from pageable memory may wait for every queued kernel)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


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


def filter_probs_rows(
    probs: torch.Tensor, top_k: Sequence[int | None], top_p: Sequence[float]
) -> torch.Tensor:
    """``filter_probs`` for many rows at once. probs: [R, V]; one top_k and top_p per row."""
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, V]
    k = to_device([vocab if kk is None else kk for kk in top_k], torch.int64, probs.device)  # [R]
    p = to_device(list(top_p), probs.dtype, probs.device)  # [R]
    keep = torch.arange(vocab, device=probs.device)[None, :] < k[:, None]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep &= (mass_before < p[:, None]) | (p[:, None] >= 1.0)  # why: top_p 1.0 must keep every token
    keep[:, 0] = True  # the most likely token always survives
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """logits: float32 [S, V] -> one token id per row, on the host (one copy back)."""
    return sample_on_device(logits, rows).tolist()


def sample_on_device(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits: float32 [S, V] -> int64 [S] on the logits' device, without waiting for the device.

    Greedy rows take one batched argmax; sampled rows share one batched softmax and top-k / top-p
    filter, and each draws its noise from its own generator (so seeded requests repeat whatever
    batch they land in).
    """
    with torch.inference_mode():  # why: the engine's logits are inference tensors; banning writes to them
        return _sample(logits.float(), rows)


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    banned = [(i, t) for i, row in enumerate(rows) for t in row.banned_ids]
    if banned:
        at_rows, at_ids = zip(*banned)
        logits[to_device(at_rows, torch.int64, logits.device), to_device(at_ids, torch.int64, logits.device)] = (
            float("-inf")
        )
    chosen = logits.argmax(dim=-1)  # [S]: right for greedy rows, overwritten for sampled ones
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if sampled:
        index = to_device(sampled, torch.int64, logits.device)
        temperature = to_device([rows[i].temperature for i in sampled], logits.dtype, logits.device)
        probs = torch.softmax(logits.index_select(0, index) / temperature[:, None], dim=-1)  # [R, V]
        if any(rows[i].top_k is not None or rows[i].top_p < 1.0 for i in sampled):
            probs = filter_probs_rows(
                probs, [rows[i].top_k for i in sampled], [rows[i].top_p for i in sampled]
            )
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and never picks p == 0.
        race = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            race[j].exponential_(generator=rows[i].generator)
        chosen.index_copy_(0, index, (probs / race).argmax(dim=-1))
    return chosen
