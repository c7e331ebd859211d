"""Workloads of ``serving_benchmark.py``: request lengths, prompts of exact token counts, arrivals.

A workload is its lengths: ``count`` requests whose input and output token counts are drawn
uniformly from inclusive ranges (a range of one value is a fixed length), from a seed, so a run and
its ``pipeline()`` baseline get the same lengths. The prompts' words are drawn from another seed per
run, so no two runs on one deployment send the same prompt: its prefix cache (on by default) finds
nothing to reuse, and every run pays its whole prefill, as the baseline does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from serving_clients import RequestSpec

SCAN_IDS = 50_000  # vocabulary entries looked at for one-token words (a real BPE has plenty early)


@dataclass(frozen=True)
class Workload:
    """``count`` requests with input and output lengths uniform over inclusive ranges."""

    input_range: tuple[int, int]
    output_range: tuple[int, int]
    count: int
    seed: int = 0

    @property
    def label(self) -> str:
        def one(lo: int, hi: int) -> str:
            return str(lo) if lo == hi else f"U[{lo},{hi}]"

        return f"{self.count} x {one(*self.input_range)} in / {one(*self.output_range)} out"

    def lengths(self) -> list[tuple[int, int]]:
        """(input, output) tokens of each request."""
        rng = random.Random(self.seed)
        return [(rng.randint(*self.input_range), rng.randint(*self.output_range)) for _ in range(self.count)]


def parse_range(text: str) -> tuple[int, int]:
    """``"128,1024"`` -> (128, 1024); ``"512"`` -> (512, 512)."""
    parts = [int(p) for p in text.split(",")]
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else parts
    if not 1 <= lo <= hi:
        raise ValueError(f"a length range needs 1 <= lo <= hi, got {text!r}")
    return lo, hi


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``count`` requests arriving at ``rate`` per second."""
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


class PromptMaker:
    """Texts that ``tokenizer`` encodes to an exact number of ids.

    A prompt is a run of one-token words: for bench/checkpoints.py's word-level tokenizer the words
    ``"t{i} "`` of its whole vocabulary (``checkpoints.word_text``); for a byte-level BPE (the demo
    model) the vocabulary's entries that are a space and letters and encode back to themselves alone,
    which no neighbour can merge with, since the pre-tokenizer splits before each space.
    """

    def __init__(self, tokenizer: Any) -> None:
        from checkpoints import word_text

        self.tokenizer = tokenizer
        self.specials = len(tokenizer.encode(""))  # a BOS the tokenizer adds counts as input
        probe = [3, 4, 5]
        if tokenizer.encode(word_text(probe), add_special_tokens=False) == probe:
            self.words = [word_text([i]) for i in range(3, len(tokenizer))]
        else:
            self.words = []
            for i in range(min(len(tokenizer), SCAN_IDS)):
                text = tokenizer.decode([i])
                if (
                    text[:1] == " "
                    and text[1:].isalpha()
                    and tokenizer.encode(text, add_special_tokens=False) == [i]
                ):
                    self.words.append(text)
        if len(self.words) < 16:
            raise ValueError(
                f"found only {len(self.words)} one-token words in the tokenizer; cannot make prompts"
            )

    def prompts(self, lengths: list[int], seed: int) -> list[str]:
        """One text per length; checked: each encodes to exactly its length."""
        rng = random.Random(seed)
        texts = ["".join(rng.choices(self.words, k=n - self.specials)) for n in lengths]
        counts = [len(ids) for ids in self.tokenizer(texts)["input_ids"]]
        wrong = [(n, c) for n, c in zip(lengths, counts) if n != c]
        assert not wrong, f"prompts of the wrong length (asked, got): {wrong[:5]}"
        return texts


def requests_for(
    maker: PromptMaker, workload: Workload, content_seed: int, rate: float | None = None
) -> list[RequestSpec]:
    """The workload's requests with prompts from ``content_seed``; with ``rate``, Poisson arrival times."""
    lengths = workload.lengths()
    prompts = maker.prompts([i for i, _ in lengths], content_seed)
    arrivals = [None] * len(lengths) if rate is None else poisson_arrivals(len(lengths), rate, content_seed)
    return [RequestSpec(p, i, o, a) for p, (i, o), a in zip(prompts, lengths, arrivals)]
