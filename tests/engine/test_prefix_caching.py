"""Prefix caching end to end: greedy outputs are identical with it on and off (prefixes ending on and
off a block boundary, prompts split across forwards, preemption, overlap), cached prompt tokens are
reported per request and in the loop's stats, and generated blocks are reusable too."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import mii_server
from mii_server.generation.response import Response
from mii_server.in_process import Pipeline

BS = 4
GREEDY = {"do_sample": False, "ignore_eos": True}


def family_prompts(seed: int, vocab: int = 380) -> list[list[int]]:
    """24 token-id prompts in 3 families sharing a prefix of 8 (on a block boundary), 13 and 6
    tokens (off one); suffixes of 0 to 9 tokens, so some prompts are their family's prefix itself."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, vocab) for _ in range(n)] for n in (8, 13, 6)]
    out = []
    for i in range(24):
        suffix = [rng.randrange(4, vocab) for _ in range(rng.randrange(0, 10))]
        out.append(prefixes[i % 3] + suffix)
    return out


def run(pipe: Pipeline, prompts: list[list[int]], **kwargs: Any) -> list[Response]:
    return pipe(prompts, **GREEDY, **kwargs)  # type: ignore[arg-type]


SETUPS = {
    # admissions spread over many steps (a 16-token budget), so later requests find earlier prefixes
    "split": {
        "max_ragged_batch_size": 16,
        "max_ragged_sequence_count": 4,
        "kv_cache": {"block_size": BS, "num_blocks": 160},
    },
    # a cache too small for everyone: preemption, and eviction of idle cached blocks
    "preemption": {
        "max_ragged_batch_size": 32,
        "max_ragged_sequence_count": 8,
        "kv_cache": {"block_size": BS, "num_blocks": 24},
    },
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_outputs_identical_on_and_off(tiny_checkpoints: dict[str, Path], setup: str, overlap: bool) -> None:
    prompts = family_prompts(seed=len(setup))
    results: dict[bool, list[list[Response]]] = {}
    for caching in (False, True):
        pipe = mii_server.pipeline(
            str(tiny_checkpoints["llama"]),
            enable_prefix_caching=caching,
            overlap_scheduling=overlap,
            **SETUPS[setup],
        )
        # twice: the second call also finds the first call's blocks, idle (or evicted) by then
        results[caching] = [run(pipe, prompts, max_new_tokens=10), run(pipe, prompts[::-1], max_new_tokens=6)]
        loop = pipe.loop
        stats = loop.stats()
        assert loop.engine.free_blocks == loop.engine.total_blocks and not loop.has_work()
        assert stats.cached_prompt_tokens == sum(r.cached_tokens for call in results[caching] for r in call)
        if setup == "preemption":
            assert stats.preemptions > 0
        if caching:
            assert stats.cached_prompt_tokens > 0
            assert loop.engine.cached_blocks > 0
        else:
            assert stats.cached_prompt_tokens == 0 and loop.engine.cached_blocks == 0
        pipe.destroy()
    for on, off in zip(results[True], results[False]):
        assert [r.token_ids for r in on] == [r.token_ids for r in off]
        assert [r.generated_text for r in on] == [r.generated_text for r in off]
    for call in results[True]:
        for prompt, r in zip(prompts, call):
            # whole blocks only, and never the last prompt token (its logits are needed)
            assert r.cached_tokens % BS == 0 and r.cached_tokens < r.prompt_length


@pytest.fixture(scope="module")
def roomy(tiny_checkpoints: dict[str, Path]) -> Pipeline:
    pipe = mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": BS, "num_blocks": 256})
    yield pipe
    pipe.destroy()


@pytest.mark.parametrize("length", [12, 13, 15], ids=["on-boundary", "one-past", "three-past"])
def test_a_repeated_prompt_reuses_every_full_block_short_of_its_last_token(
    roomy: Pipeline, length: int
) -> None:
    prompt = [7 + (i * 37 + length) % 300 for i in range(length)]
    first, second = run(roomy, [prompt], max_new_tokens=5)[0], run(roomy, [prompt], max_new_tokens=5)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == (length - 1) // BS * BS  # 12 tokens: 8 (the third block is recomputed)
    assert second.token_ids == first.token_ids


def test_generated_blocks_are_reused_by_a_continuation(
    roomy: Pipeline, tiny_checkpoints: dict[str, Path]
) -> None:
    """A chat's next turn repeats the previous answer: its blocks are cached too."""
    prompt = [11 + (i * 53) % 300 for i in range(9)]
    answer = run(roomy, [prompt], max_new_tokens=14)[0]
    follow_up = prompt + answer.token_ids[:12] + [5, 6, 7]
    again = run(roomy, [follow_up], max_new_tokens=6)[0]
    assert again.cached_tokens == (len(follow_up) - 1) // BS * BS  # 20 of 24: past the prompt's 8
    plain = mii_server.pipeline(str(tiny_checkpoints["llama"]), enable_prefix_caching=False)
    assert again.token_ids == run(plain, [follow_up], max_new_tokens=6)[0].token_ids
    plain.destroy()


def test_prompt_logprobs_requests_compute_their_whole_prompt(roomy: Pipeline) -> None:
    prompt = [9 + (i * 29) % 300 for i in range(14)]
    run(roomy, [prompt], max_new_tokens=2)
    with_lp = run(roomy, [prompt], max_new_tokens=2, prompt_logprobs=0)[0]
    assert with_lp.cached_tokens == 0 and len(with_lp.prompt_logprobs) == len(prompt)
    assert run(roomy, [prompt], max_new_tokens=2)[0].cached_tokens == 12  # and it registered its blocks
