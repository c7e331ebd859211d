"""``prepare_many``: an RPC's or a pipeline call's text prompts tokenised in one batch, with what
one-at-a-time tokenisation gives, and the same refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from mii_server.batching.loop import GenerationLoop
from mii_server.config import ModelConfig
from mii_server.errors import InvalidRequest
from mii_server.generation.params import GenerateParams
from mii_server.runtime import build_loop, build_runtime

PARAMS = GenerateParams.from_kwargs(max_new_tokens=4)


@pytest.fixture(scope="module")
def loop(tiny_checkpoints: dict[str, Path]) -> GenerationLoop:
    config = ModelConfig(model_name_or_path=str(tiny_checkpoints["llama"]))
    return build_loop(config, build_runtime(config))


def test_batched_tokenisation_equals_one_at_a_time(loop: GenerationLoop) -> None:
    assert loop.tokenizer.is_fast  # the batched path is taken
    prompts: list[str | list[int]] = [
        "Multilingual text: café, 東京, 🙂",
        [5, 6, 7],  # token ids among the texts keep their places
        "  leading spaces and a\nnewline",
        "The quick brown fox " * 40,
    ]
    batched = loop.prepare_many(prompts, PARAMS, [print] * len(prompts))
    single = [loop.prepare(p, PARAMS, print) for p in prompts]
    assert [r.prompt_ids for r in batched] == [r.prompt_ids for r in single]
    assert [r.prompt_ids for r in batched][1] == [5, 6, 7]
    assert [r.prompt_text for r in batched] == [r.prompt_text for r in single]
    assert len({r.uid for r in batched + single}) == 2 * len(prompts)
    assert [r.sink for r in loop.prepare_many(["a", "b"], PARAMS, [print, repr])] == [print, repr]


def test_one_bad_prompt_refuses_the_batch(loop: GenerationLoop) -> None:
    too_long = "x" * (loop.context_length * 64 + 1)
    with pytest.raises(InvalidRequest, match="characters"):
        loop.prepare_many(["fine", too_long], PARAMS, [print, print])
    with pytest.raises(InvalidRequest, match="empty"):
        loop.prepare_many(["fine", []], PARAMS, [print, print])
    assert not loop.has_work()  # nothing was queued
