"""Overlapped scheduling: step N+1 is queued before step N's sampled ids are read back, and feeds
them to the model on the device. Outputs must equal the synchronous loop's token for token, whatever
stops a request (length, stop token, stop string, abort) and under preemption and split prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import mii_server
from mii_server.batching.executor import run_step
from mii_server.batching.request import RequestUpdate
from mii_server.batching.step import Step
from mii_server.generation.params import GenerateParams
from mii_server.in_process import Pipeline

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 0 1 2 3 4 5 6 7 8 9",
    "abc",
    "A somewhat longer prompt that has to be split across several forwards of a small budget.",
]


def make_pipe(checkpoint: Path, overlap: bool, **config: Any) -> Pipeline:
    config.setdefault("kv_cache", {"block_size": 4, "num_blocks": 128})
    return mii_server.pipeline(str(checkpoint), overlap_scheduling=overlap, **config)


def outputs(pipe: Pipeline, **kwargs: Any) -> list[tuple[list[int], str, str]]:
    return [(r.token_ids, r.generated_text, r.finish_reason.value) for r in pipe(PROMPTS, **kwargs)]


@pytest.fixture(scope="module")
def pipes(tiny_checkpoints: dict[str, Path]) -> dict[bool, Pipeline]:
    """overlap -> pipeline with a small token budget and sequence cap (prompts split, decodes mix in)."""
    out = {
        overlap: make_pipe(
            tiny_checkpoints["llama"], overlap, max_ragged_batch_size=16, max_ragged_sequence_count=4
        )
        for overlap in (False, True)
    }
    yield out
    for pipe in out.values():
        pipe.destroy()


def test_overlap_is_on_for_one_rank(pipes: dict[bool, Pipeline]) -> None:
    assert pipes[True].loop.overlap and not pipes[False].loop.overlap


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 12, "do_sample": False, "ignore_eos": True},
        {"max_new_tokens": 1, "do_sample": False, "ignore_eos": True},
        {"max_new_tokens": 10, "do_sample": True, "temperature": 0.9, "top_p": 0.8, "seed": 7, "ignore_eos": True},
        {"max_new_tokens": 10, "do_sample": True, "top_k": 5, "seed": 3, "min_new_tokens": 4},
    ],
    ids=["greedy", "one-token", "top-p", "top-k-min-new"],
)
def test_overlap_equals_synchronous(pipes: dict[bool, Pipeline], kwargs: dict[str, Any]) -> None:
    assert outputs(pipes[True], **kwargs) == outputs(pipes[False], **kwargs)
    for pipe in pipes.values():
        assert pipe.loop.engine.free_blocks == pipe.loop.engine.total_blocks
        assert not pipe.loop.has_work()


def test_stops_inside_the_overlap_discard_the_extra_token(pipes: dict[bool, Pipeline]) -> None:
    """A request stopped by a token of step N was already queued in N+1: nothing of N+1 shows."""
    greedy = {"max_new_tokens": 12, "do_sample": False, "ignore_eos": True}
    full = outputs(pipes[False], **greedy)
    stop_id = full[1][0][3]  # the 4th token of the second prompt stops it (and maybe others)
    stop_text = pipes[False].tokenizer.decode(full[2][0][2:4])
    for kwargs in ({"stop_token_ids": [stop_id]}, {"stop": [stop_text]}):
        sync, overlapped = outputs(pipes[False], **greedy, **kwargs), outputs(pipes[True], **greedy, **kwargs)
        assert overlapped == sync
        assert any(reason == "stop" for _, _, reason in sync)
    assert pipes[True].loop.engine.free_blocks == pipes[True].loop.engine.total_blocks


def test_steps_feed_sampled_tokens_back_before_reading_them(pipes: dict[bool, Pipeline]) -> None:
    loop = pipes[True].loop
    steps: list[Step] = []

    class Recording:
        engine = loop.engine

        def execute(self, step: Step) -> torch.Tensor | None:
            steps.append(step)
            return run_step(self.engine, step)

    executor, loop.executor = loop.executor, Recording()
    try:
        pipes[True](PROMPTS[:2], max_new_tokens=6, do_sample=False, ignore_eos=True)
    finally:
        loop.executor = executor
    placeholders = [t for s in steps for chunk in s.tokens for t in chunk if t < 0]
    assert placeholders and set(placeholders) <= {-1, -2}  # rows of the previous step's samples
    # every decode step was queued before its input token was known on the host
    assert all(len(chunk) > 1 or chunk[0] < 0 for s in steps[2:] for chunk in s.tokens)


def test_abort_while_a_token_is_in_flight(pipes: dict[bool, Pipeline]) -> None:
    loop = pipes[True].loop
    updates: list[RequestUpdate] = []
    params = GenerateParams(max_new_tokens=50, do_sample=False, ignore_eos=True)
    uid = loop.submit(PROMPTS[0], params, updates.append)
    while len(updates) < 3:
        loop.step()
    assert loop.has_work()
    loop.abort(uid)
    while loop.has_work():
        loop.step()
    assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]
    assert updates[-1].response.finish_reason.value == "abort"
    assert loop.engine.free_blocks == loop.engine.total_blocks


def test_overlap_under_preemption_equals_synchronous(tiny_checkpoints: dict[str, Path]) -> None:
    kwargs = {"max_new_tokens": 12, "do_sample": False, "ignore_eos": True}
    results = {}
    for overlap in (False, True):
        pipe = make_pipe(tiny_checkpoints["llama"], overlap, kv_cache={"block_size": 4, "num_blocks": 24})
        results[overlap] = outputs(pipe, **kwargs)
        assert pipe.loop.scheduler.num_preemptions > 0
        assert pipe.loop.engine.free_blocks == pipe.loop.engine.total_blocks
        pipe.destroy()
    assert results[True] == results[False]
