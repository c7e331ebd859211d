"""Greedy agreement of a quantized pipeline with the unquantized one, on the tiny test checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mii_server

PROMPTS = [
    "Hello", "The quick brown fox", "Numbers 0 1 2 3", "café 東京", "A model server answers requests",
    "Ragged batching packs", "Deployments have replicas", "Large language models predict the next",
    "a tokenizer turns text", "Clients stream tokens", "punctuation ,.;:!?", "Multilingual text: Grüße",
    "emoji 🙂🚀 and symbols @#$", "blocked KV cache holds", "1000 100 10", "over the lazy dog.",
]  # fmt: skip
NEW_TOKENS = 16


@dataclass(frozen=True)
class Agreement:
    """How often greedy tokens of two runs over the same prompts agree."""

    identical: int  # prompts whose NEW_TOKENS tokens are all the same
    first_token: int  # prompts whose first generated token is the same
    positions: int  # token positions that agree, over all prompts
    prompts: int

    def __str__(self) -> str:
        n = self.prompts
        return (f"{self.identical}/{n} prompts identical, first token {self.first_token}/{n}, "
                f"{self.positions}/{n * NEW_TOKENS} positions")  # fmt: skip


def greedy(path: str, **model_kwargs: Any) -> list[list[int]]:
    pipe = mii_server.pipeline(path, **model_kwargs)
    try:
        return [r.token_ids for r in pipe(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True)]
    finally:
        pipe.destroy()


def agreement(reference: list[list[int]], other: list[list[int]]) -> Agreement:
    return Agreement(
        identical=sum(a == b for a, b in zip(reference, other)),
        first_token=sum(a[0] == b[0] for a, b in zip(reference, other)),
        positions=sum(x == y for a, b in zip(reference, other) for x, y in zip(a, b)),
        prompts=len(reference),
    )
