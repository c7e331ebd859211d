"""Generation parameters and pipeline arguments: unknown names and bad values raise clear typed
errors, and a bad request disturbs no other request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mii_server
from mii_server.batching.request import RequestUpdate
from mii_server.errors import EngineDead, InvalidRequest, UnknownArgument, UnsupportedModel
from mii_server.generation.params import GenerateParams
from mii_server.in_process import Pipeline

PROMPTS = ["Hello", "The quick brown fox"]
GREEDY = {"max_new_tokens": 10, "do_sample": False, "ignore_eos": True}
LONG_PROMPT = " ".join(["fox"] * 1100)  # more tokens than the tiny model's 1024 positions


@pytest.fixture(scope="module")
def pipe(tiny_checkpoints: dict[str, Path]) -> Pipeline:
    return mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 16, "num_blocks": 96})


@pytest.fixture(scope="module")
def reference(pipe: Pipeline) -> list[list[int]]:
    return [r.token_ids for r in pipe(PROMPTS, **GREEDY)]


def assert_idle(pipe: Pipeline) -> None:
    loop = pipe.loop
    assert loop is not None and not loop.has_work()
    assert loop.engine.free_blocks == loop.engine.total_blocks


def test_unknown_generate_kwarg(pipe: Pipeline) -> None:
    with pytest.raises(UnknownArgument, match="max_tokens") as info:
        pipe("Hello", max_tokens=5)
    assert "max_new_tokens" in str(info.value)  # the message lists the known names
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_length": -5}, "max_length"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_new_tokens": 2, "min_new_tokens": 5}, "min_new_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
        ({"logit_bias": [5, 1]}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
    ],
)
def test_bad_values_raise_invalid_request(
    pipe: Pipeline, reference: list[list[int]], kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequest, match=field) as info:
        pipe(PROMPTS, **kwargs)
    assert str(info.value).startswith("invalid generation parameters")
    assert_idle(pipe)


def test_logit_bias_keys_from_json_and_the_vocabulary_bound(pipe: Pipeline) -> None:
    assert GenerateParams.from_kwargs(logit_bias={"7": -100, 9: 2}).logit_bias == {7: -100.0, 9: 2.0}
    vocab = pipe.loop.vocab_size
    with pytest.raises(InvalidRequest, match=f"logit_bias names token {vocab}; the vocabulary has {vocab}"):
        pipe(PROMPTS, logit_bias={vocab: 1.0}, **GREEDY)
    assert_idle(pipe)


def test_prompt_longer_than_the_context(pipe: Pipeline, reference: list[list[int]]) -> None:
    n = len(pipe.tokenizer.encode(LONG_PROMPT))
    assert n > 1024
    with pytest.raises(
        InvalidRequest, match=f"prompt has {n} tokens.*max_length=1024 \\(model context 1024\\)"
    ):
        pipe([PROMPTS[0], LONG_PROMPT, PROMPTS[1]], **GREEDY)
    assert_idle(pipe)  # the good prompts of that call were not queued either
    assert [r.token_ids for r in pipe(PROMPTS, **GREEDY)] == reference


def test_request_larger_than_the_kv_cache(tiny_checkpoints: dict[str, Path]) -> None:
    small = mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 16, "num_blocks": 8})
    n = len(small.tokenizer.encode(PROMPTS[0]))
    # 8 blocks of 16 tokens hold 128 tokens: the prompt plus 200 new tokens do not fit.
    with pytest.raises(
        InvalidRequest, match=f"prompt \\({n} tokens\\) plus up to 200 new tokens needs 13 KV blocks"
    ):
        small(PROMPTS[0], max_new_tokens=200)
    assert_idle(small)
    assert small(PROMPTS[0], max_new_tokens=4, do_sample=False)[0].generated_length == 4
    small.destroy()


def test_max_length_not_above_the_prompt(pipe: Pipeline) -> None:
    n = len(pipe.tokenizer.encode(PROMPTS[1]))
    with pytest.raises(InvalidRequest, match=f"prompt has {n} tokens.*max_length={n}"):
        pipe(PROMPTS[1], max_length=n)


def test_bad_request_while_others_run(pipe: Pipeline, reference: list[list[int]]) -> None:
    loop = pipe.loop
    assert loop is not None
    updates: dict[int, list[RequestUpdate]] = {}
    params = GenerateParams(**GREEDY)  # type: ignore[arg-type]
    uids = []
    for prompt in PROMPTS:
        uid = loop.submit(prompt, params, lambda u: updates[u.uid].append(u))
        updates[uid] = []
        uids.append(uid)
    for _ in range(3):
        loop.step()
    assert all(updates[uid] for uid in uids)  # both are generating
    with pytest.raises(InvalidRequest, match="prompt has"):
        loop.submit(LONG_PROMPT, params, lambda u: None)
    with pytest.raises(InvalidRequest, match="empty"):
        loop.submit("", params, lambda u: None)
    while loop.has_work():
        loop.step()
    assert [[t for u in updates[uid] for t in u.response.token_ids] for uid in uids] == reference
    assert all(updates[uid][-1].response.finish_reason == "length" for uid in uids)
    assert_idle(pipe)


def test_unknown_model_kwarg(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(UnknownArgument, match="max_batch"):
        mii_server.pipeline(str(tiny_checkpoints["llama"]), max_batch=4)


def test_bad_model_kwarg_value(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequest, match="power of two"):
        mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 12})
    with pytest.raises(InvalidRequest, match="max_ragged_sequence_count"):
        mii_server.pipeline(
            str(tiny_checkpoints["llama"]), max_ragged_batch_size=4, max_ragged_sequence_count=8
        )


def test_unsupported_model_type_lists_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    supported = "falcon, gemma2, llama, mistral, mixtral, opt, phi, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe"
    with pytest.raises(UnsupportedModel, match=f"'gpt2' is not supported; supported: {supported}"):
        mii_server.pipeline(str(tmp_path))


def test_destroy_then_call_raises_engine_dead(tiny_checkpoints: dict[str, Path]) -> None:
    doomed = mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 16, "num_blocks": 8})
    assert doomed("Hello", max_new_tokens=2)[0].generated_length == 2
    doomed.destroy()
    with pytest.raises(EngineDead):
        doomed("Hello", max_new_tokens=2)
    with pytest.raises(EngineDead):
        _ = doomed.tokenizer
    doomed.destroy()  # a second destroy is harmless


@pytest.mark.parametrize(
    "kwargs",
    [{"do_sample": "yes"}, {"ignore_eos": 1}, {"max_new_tokens": "5"}, {"max_new_tokens": 5.0}, {"seed": "7"}],
)
def test_wrong_types_are_refused_not_coerced(kwargs: dict) -> None:
    with pytest.raises(InvalidRequest):
        GenerateParams.from_kwargs(**kwargs)


def test_ints_pass_for_floats_and_tuples_for_lists() -> None:
    params = GenerateParams.from_kwargs(temperature=1, top_p=1, stop=("a", "b"))
    assert (params.temperature, params.top_p, params.stop) == (1.0, 1.0, ["a", "b"])


def test_max_new_tokens_past_the_context_is_cut_or_refused() -> None:
    assert GenerateParams.from_kwargs(max_new_tokens=100).limits_for(30, 64, 64) == 34  # MII: cut
    strict = GenerateParams.from_kwargs(max_new_tokens=100, truncate_max_new_tokens=False)
    with pytest.raises(InvalidRequest, match="maximum context length is 64 tokens, but 130 were requested"):
        strict.limits_for(30, 64, 64)
    assert strict.limits_for(30, 200, 200) == 100
