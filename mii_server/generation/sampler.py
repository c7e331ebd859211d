"""Token selection for a batch of rows, each with its own parameters and random generator.

Everything stays on the logits' device until the chosen ids are copied back once. One batch goes
through, in this order (vLLM's): raw log-probabilities (rows that ask), logit_bias, penalties
(repetition, then frequency and presence), banned ids; then greedy rows take the argmax and sampled
rows apply temperature, min_p, top-k / top-p and draw. Each stage runs only when some row uses it,
batched over those rows: no per-request Python loop over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..kernels import get_ops
from .logprobs import Logprobs, logprobs_of

if TYPE_CHECKING:
    from .penalties import PenaltyCounts


@dataclass
class SamplingRow:
    """How to pick the next token for one sequence."""

    greedy: bool  # argmax; temperature, top_k, top_p, min_p and generator are then ignored
    temperature: float  # divides logits (1.0 = unchanged)
    top_k: int | None  # keep the k most likely tokens
    top_p: float  # keep the smallest set whose probability reaches top_p (1.0 = all)
    generator: torch.Generator | None  # the request's own stream (seeded), on the logits' device
    banned_ids: Sequence[int] = ()  # ids that must not be picked now (EOS before min_new_tokens)
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely (0 = all)
    bias_ids: Sequence[int] = ()  # logit_bias: these ids get bias_values added to their logits
    bias_values: Sequence[float] = ()
    penalty_row: int | None = None  # the request's PenaltyCounts row; None: no penalties
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # return the chosen token's log-probability and this many alternatives
    # whether any of logprobs, penalties, logit_bias applies (one check per row on the hot path)
    extras: bool = field(init=False)

    def __post_init__(self) -> None:
        self.extras = self.logprobs is not None or self.penalty_row is not None or bool(self.bias_ids)


@dataclass
class SampledTokens:
    """One batch's choices, still on the device."""

    ids: torch.Tensor  # int64 [S]: the chosen token of each row
    logprob_rows: list[int] = field(default_factory=list)  # rows that asked for log-probabilities
    logprobs: Logprobs | None = None  # for those rows, in that order


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


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], penalties: PenaltyCounts | None = None
) -> list[int]:
    """logits: float32 [S, V] -> one token id per row, on the host (one copy back)."""
    return sample_on_device(logits, rows, penalties).ids.tolist()


def sample_on_device(
    logits: torch.Tensor, rows: Sequence[SamplingRow], penalties: PenaltyCounts | None = None
) -> SampledTokens:
    """logits: float32 [S, V] -> the chosen ids (int64 [S]) and asked-for log-probabilities, on the
    logits' device, without waiting for the device.

    Greedy rows take one batched argmax; sampled rows share one batched softmax and filters, and
    each draws its noise from its own generator (so seeded requests repeat whatever batch they land
    in). ``logits`` is modified in place. Rows with a ``penalty_row`` need ``penalties``, whose
    counts then take the chosen ids.
    """
    with torch.inference_mode():  # why: the engine's logits are inference tensors; banning writes to them
        return _sample(logits.float(), rows, penalties)


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.int64, device)


def _sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], penalties: PenaltyCounts | None
) -> SampledTokens:
    device = logits.device
    out = SampledTokens(ids=torch.empty(0))
    extras = [i for i, row in enumerate(rows) if row.extras]
    out.logprob_rows = [i for i in extras if rows[i].logprobs is not None]
    raw = logits.index_select(0, _index(out.logprob_rows, device)) if out.logprob_rows else None  # [L, V]
    _bias(logits, [(i, rows[i]) for i in extras if rows[i].bias_ids])
    penalised = [i for i in extras if rows[i].penalty_row is not None]
    if penalised:
        assert penalties is not None, "rows with a penalty_row need the PenaltyCounts"
        at_rows = _index(penalised, device)
        table_rows = _index([rows[i].penalty_row for i in penalised], device)  # type: ignore[misc]
        values = [(rows[i].presence_penalty, rows[i].frequency_penalty, rows[i].repetition_penalty) for i in penalised]
        presence, frequency, repetition = to_device(values, logits.dtype, device).unbind(1)  # [P] each
        penalties.apply(logits, at_rows, table_rows, presence, frequency, repetition)
    banned = [(i, t) for i, row in enumerate(rows) for t in row.banned_ids]
    if banned:
        at_rows, at_ids = zip(*banned)
        logits[_index(at_rows, device), _index(at_ids, device)] = float("-inf")
    argmax_rows = get_ops(device).argmax_rows
    chosen = argmax_rows(logits)  # [S]: right for greedy rows, overwritten for sampled ones
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if sampled:
        index = _index(sampled, device)
        temperature = to_device([rows[i].temperature for i in sampled], logits.dtype, device)
        probs = torch.softmax(logits.index_select(0, index) / temperature[:, None], dim=-1)  # [R, V]
        if any(rows[i].min_p > 0 for i in sampled):
            min_p = to_device([rows[i].min_p for i in sampled], logits.dtype, device)
            probs = probs * (probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True))
            probs = probs / probs.sum(dim=-1, keepdim=True)  # why: top-p reads the renormalised mass
        if any(rows[i].top_k is not None or rows[i].top_p < 1.0 for i in sampled):
            probs = filter_probs_rows(
                probs, [rows[i].top_k for i in sampled], [rows[i].top_p for i in sampled]
            )
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and never picks p == 0.
        race = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            race[j].exponential_(generator=rows[i].generator)
        chosen.index_copy_(0, index, argmax_rows(probs / race))
    if raw is not None:
        at_rows = _index(out.logprob_rows, device)
        k = max(rows[i].logprobs or 0 for i in out.logprob_rows)
        out.logprobs = logprobs_of(raw, chosen.index_select(0, at_rows), k)
    if penalised:
        assert penalties is not None
        penalties.count(table_rows, chosen.index_select(0, _index(penalised, device)))
    out.ids = chosen
    return out


def _bias(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingRow]]) -> None:
    """Add the logit_bias of each (batch row, its SamplingRow) (in place; one scatter for the batch)."""
    if not rows:
        return
    at_rows = [i for i, row in rows for _ in row.bias_ids]
    at_ids = [t for _, row in rows for t in row.bias_ids]
    values = [v for _, row in rows for v in row.bias_values]
    index = (_index(at_rows, logits.device), _index(at_ids, logits.device))
    logits.index_put_(index, to_device(values, logits.dtype, logits.device), accumulate=True)
