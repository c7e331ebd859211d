"""pipeline(): responses in prompt order with exact lengths; max_length vs max_new_tokens;
return_full_text."""

from __future__ import annotations

from pathlib import Path

import pytest

import mii_server
from mii_server.in_process import Pipeline

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "Numbers 0 1 2 3"]
GREEDY = {"do_sample": False, "ignore_eos": True}


@pytest.fixture(scope="module")
def pipe(tiny_checkpoints: dict[str, Path]) -> Pipeline:
    return mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 16, "num_blocks": 64})


@pytest.fixture(scope="module")
def prompt_lengths(pipe: Pipeline) -> list[int]:
    return [len(pipe.tokenizer.encode(p)) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(pipe: Pipeline) -> list[list[int]]:
    """Greedy tokens of each prompt, run alone."""
    return [pipe(p, max_new_tokens=16, **GREEDY)[0].token_ids for p in PROMPTS]


def test_responses_in_prompt_order(
    pipe: Pipeline, prompt_lengths: list[int], reference: list[list[int]]
) -> None:
    responses = pipe(PROMPTS[::-1], max_new_tokens=16, **GREEDY)
    assert [r.token_ids for r in responses] == reference[::-1]
    assert [r.prompt_length for r in responses] == prompt_lengths[::-1]
    for r in responses:
        assert r.generated_length == 16 == len(r.token_ids)
        assert r.finish_reason == "length"
        # An incomplete character at the very end is released when generation ends, as U+FFFD,
        # exactly as a whole decode of the ids shows it: nothing is lost.
        assert str(r) == r.generated_text == pipe.tokenizer.decode(r.token_ids)


def test_single_string_prompt(pipe: Pipeline, reference: list[list[int]]) -> None:
    responses = pipe(PROMPTS[1], max_new_tokens=16, **GREEDY)
    assert len(responses) == 1 and responses[0].token_ids == reference[1]


def test_max_length_counts_the_prompt(
    pipe: Pipeline, prompt_lengths: list[int], reference: list[list[int]]
) -> None:
    n = prompt_lengths[1]
    r = pipe(PROMPTS[1], max_length=n + 5, **GREEDY)[0]
    assert r.token_ids == reference[1][:5] and r.finish_reason == "length"
    # Both given: the tighter one wins.
    assert pipe(PROMPTS[1], max_length=n + 5, max_new_tokens=3, **GREEDY)[0].generated_length == 3
    assert pipe(PROMPTS[1], max_length=n + 5, max_new_tokens=9, **GREEDY)[0].generated_length == 5
    # One max_length for a batch: each prompt gets what its own length leaves.
    out = pipe(PROMPTS, max_length=max(prompt_lengths) + 2, **GREEDY)
    assert [r.generated_length for r in out] == [max(prompt_lengths) + 2 - m for m in prompt_lengths]


def test_default_max_length_is_the_model_context(pipe: Pipeline, prompt_lengths: list[int]) -> None:
    loop = pipe.loop
    assert loop is not None and loop.context_length == 1024 and loop.default_max_length == 1024


def test_model_max_length_is_the_default(tiny_checkpoints: dict[str, Path]) -> None:
    short = mii_server.pipeline(
        str(tiny_checkpoints["llama"]), max_length=8, kv_cache={"block_size": 16, "num_blocks": 4}
    )
    n = len(short.tokenizer.encode(PROMPTS[0]))
    assert short(PROMPTS[0], **GREEDY)[0].generated_length == 8 - n
    assert short(PROMPTS[0], max_length=10, **GREEDY)[0].generated_length == 10 - n
    short.destroy()


def test_return_full_text(pipe: Pipeline, reference: list[list[int]]) -> None:
    plain = pipe(PROMPTS, max_new_tokens=16, **GREEDY)
    full = pipe(PROMPTS, max_new_tokens=16, return_full_text=True, **GREEDY)
    for prompt, p, f in zip(PROMPTS, plain, full):
        assert f.generated_text == prompt + p.generated_text
        assert f.token_ids == p.token_ids and f.generated_length == p.generated_length


def test_batch_equals_one_by_one_and_frees_every_block(pipe: Pipeline, reference: list[list[int]]) -> None:
    assert [r.token_ids for r in pipe(PROMPTS * 3, max_new_tokens=16, **GREEDY)] == reference * 3
    loop = pipe.loop
    assert loop is not None
    assert loop.engine.free_blocks == loop.engine.total_blocks and not loop.has_work()
