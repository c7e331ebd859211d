"""Log-probabilities of chosen tokens and their top alternatives, computed on the device in one batch.

Raw log-probabilities (vLLM's default ``raw_logprobs``): the model's log-softmax over the whole
vocabulary, before temperature, penalties, logit_bias, filters and banned ids. Only the rows that
ask for them pay for the full-vocabulary softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .response import TokenLogprob, TopLogprob


@dataclass
class Logprobs:
    """Device tensors for L positions, the top ``k`` of each (k: the largest any row asked for)."""

    chosen: torch.Tensor  # float32 [L]: log-probability of the token at each position
    top_ids: torch.Tensor  # int64 [L, k]: the k most likely tokens, most likely first
    top_logprobs: torch.Tensor  # float32 [L, k]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.chosen, self.top_ids, self.top_logprobs


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, k: int) -> Logprobs:
    """logits: float32 [L, V]; targets: int64 [L] (the tokens whose log-probability is asked)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
    chosen = log_probs.gather(1, targets[:, None]).squeeze(1)  # [L]
    top_logprobs, top_ids = log_probs.topk(k, dim=-1)  # [L, k] (k may be 0)
    return Logprobs(chosen=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


def token_logprobs(
    token_ids: Sequence[int],
    chosen: Sequence[float],
    top_ids: Sequence[Sequence[int]],
    top_logprobs: Sequence[Sequence[float]],
    ks: Sequence[int],
    token_text: Callable[[int], str],
) -> list[TokenLogprob]:
    """Host lists (as read back from a ``Logprobs``) -> one TokenLogprob per position, keeping the
    top ``ks[i]`` alternatives of position i."""
    return [
        TokenLogprob(
            token_id=t,
            token=token_text(t),
            logprob=lp,
            top_logprobs=[TopLogprob(i, token_text(i), v) for i, v in zip(ids[:k], vals[:k])],
        )
        for t, lp, ids, vals, k in zip(token_ids, chosen, top_ids, top_logprobs, ks)
    ]
