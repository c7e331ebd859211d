"""Sampling: seeded runs repeat, top-k / top-p never emit excluded tokens, greedy ignores top_p,
temperature sharpens and flattens."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.generation.sampler import SamplingRow, filter_probs, sample
from mii_server.in_process import Pipeline

DRAWS = 2000
PROMPTS = ["Hello", "The quick brown fox", "A model server answers"]


def draw(logits: list[float], n: int = DRAWS, seed: int = 0, **row: object) -> Counter[int]:
    """Sample ``n`` tokens from one row of ``logits`` and count them."""
    gen = torch.Generator().manual_seed(seed)
    settings = {"greedy": False, "temperature": 1.0, "top_k": None, "top_p": 1.0, **row}
    rows = [SamplingRow(generator=gen, **settings) for _ in range(n)]  # type: ignore[arg-type]
    return Counter(sample(torch.tensor([logits]).repeat(n, 1), rows))


PROBS = [0.125, 0.5, 0.25, 0.0625, 0.0625]  # exact in binary: no rounding at the nucleus edge
LOGITS = torch.tensor(PROBS).log().tolist()


def test_filter_probs_exact() -> None:
    probs = torch.tensor(PROBS)
    assert filter_probs(probs, None, 1.0) is probs
    assert filter_probs(probs, 2, 1.0).tolist() == [0.0, 0.5, 0.25, 0.0, 0.0]
    assert filter_probs(probs, 1, 1.0).tolist() == [0.0, 0.5, 0.0, 0.0, 0.0]
    # Nucleus: the smallest set whose mass reaches top_p (0.5 + 0.25 >= 0.75).
    assert filter_probs(probs, None, 0.75).tolist() == [0.0, 0.5, 0.25, 0.0, 0.0]
    assert filter_probs(probs, None, 0.76).tolist() == [0.125, 0.5, 0.25, 0.0, 0.0]
    assert filter_probs(probs, None, 0.5).tolist() == [0.0, 0.5, 0.0, 0.0, 0.0]
    assert filter_probs(probs, None, 0.01).tolist() == [0.0, 0.5, 0.0, 0.0, 0.0]  # the top token survives
    assert filter_probs(probs, 3, 0.6).tolist() == [0.0, 0.5, 0.25, 0.0, 0.0]  # both filters apply


@pytest.mark.parametrize(
    "row, allowed",
    [
        ({"top_k": 2}, {1, 2}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.75}, {1, 2}),
        ({"top_p": 0.8}, {0, 1, 2}),
        ({"top_k": 2, "top_p": 0.9}, {1, 2}),
        ({"top_p": 1.0}, {0, 1, 2, 3, 4}),
    ],
)
def test_sampling_never_emits_excluded_tokens(row: dict[str, object], allowed: set[int]) -> None:
    counts = draw(LOGITS, **row)
    assert set(counts) == allowed  # nothing outside, and every allowed token does occur


def test_sampling_follows_the_distribution() -> None:
    counts = draw(LOGITS, n=4000)
    for token, p in enumerate(PROBS):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_seeded_draws_repeat_and_seeds_differ() -> None:
    assert draw(LOGITS, n=200, seed=5) == draw(LOGITS, n=200, seed=5)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    rows = lambda g: [SamplingRow(False, 1.0, None, 1.0, g) for _ in range(50)]
    logits = torch.tensor([LOGITS]).repeat(50, 1)
    assert sample(logits, rows(gen_a)) == sample(logits, rows(gen_b))
    assert sample(logits, rows(torch.Generator().manual_seed(6))) != sample(logits, rows(gen_a))


def test_greedy_ignores_top_p_top_k_and_temperature() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 0.0]])
    rows = [SamplingRow(True, 0.01, 1, 0.01, None), SamplingRow(True, 50.0, None, 0.2, None)]
    assert sample(logits, rows) == [1, 0]


def test_banned_ids_are_never_picked() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    assert sample(logits.clone(), [SamplingRow(True, 1.0, None, 1.0, None, banned_ids=[1])]) == [2]
    counts = draw([0.0, 3.0, 2.9, -1.0], n=500, banned_ids=[1, 2])
    assert set(counts) == {0, 3}


def test_temperature() -> None:
    cold = draw([2.0, 1.0, 0.0], temperature=0.01)
    assert cold == Counter({0: DRAWS})  # exp(-100): effectively greedy
    hot = draw([2.0, 1.0, 0.0], temperature=100.0, n=3000)
    assert all(abs(hot[t] / 3000 - 1 / 3) < 0.04 for t in range(3))  # almost uniform
    warm = draw([2.0, 1.0, 0.0], n=3000)
    assert abs(warm[0] / 3000 - 0.665) < 0.03  # softmax([2, 1, 0])[0] = 0.665


# ---- through the pipeline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipe(tiny_checkpoints: dict[str, Path]) -> Pipeline:
    return mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 16, "num_blocks": 64})


def tokens(pipe: Pipeline, **kwargs: object) -> list[list[int]]:
    return [r.token_ids for r in pipe(PROMPTS, max_new_tokens=10, ignore_eos=True, **kwargs)]


def test_pipeline_same_seed_repeats_different_seeds_differ(pipe: Pipeline) -> None:
    first = tokens(pipe, do_sample=True, seed=7)
    assert tokens(pipe, do_sample=True, seed=7) == first
    assert tokens(pipe, do_sample=True, seed=7, top_p=1.0) != first  # top_p is in effect when sampling
    other = tokens(pipe, do_sample=True, seed=8)
    assert all(a != b for a, b in zip(first, other))
    assert tokens(pipe, do_sample=False) != first


def test_pipeline_greedy_ignores_top_p_and_temperature(pipe: Pipeline) -> None:
    greedy = tokens(pipe, do_sample=False)
    assert tokens(pipe, do_sample=False, top_p=0.05, temperature=5.0, top_k=3) == greedy
    assert tokens(pipe, do_sample=True, seed=3, top_k=1) == greedy  # top-1 sampling is greedy
