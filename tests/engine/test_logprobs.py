"""Log-probabilities: each generated token's and each prompt token's log-probability and top-k
alternatives equal a direct transformers forward's log_softmax (float32, 1e-4), raw (before any
sampling control), whatever the batching (chunked prompts, preemption, overlap); carried on
Response, streamed once per update, and through the tensor-parallel message form."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.batching.request import RequestUpdate
from mii_server.generation.params import GenerateParams
from mii_server.generation.response import Response, TokenLogprob

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, and multilingual text: café, 東京, 🙂",
    "A",
]
TOL = 1e-4


def hf_log_softmax(hf_llama: tuple, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the distribution of the token after ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf_llama[1](torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_entry(entry: TokenLogprob, expected_row: torch.Tensor, token_id: int, k: int, tok: object) -> None:
    assert entry.token_id == token_id
    assert entry.token == tok.decode([token_id])  # type: ignore[attr-defined]
    assert abs(entry.logprob - expected_row[token_id].item()) < TOL
    values, ids = expected_row.topk(k)
    assert [t.token_id for t in entry.top_logprobs] == ids.tolist()
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=TOL)
    assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in ids.tolist()]  # type: ignore[attr-defined]


SETUPS = {
    "roomy": {},
    # prompts split into chunks of at most 5 tokens (and 3 logit rows) across forwards
    "chunked": {"max_ragged_batch_size": 5, "max_ragged_sequence_count": 3},
    # too few blocks for all prompts at once: preemption recomputes prompts (not their log-probs)
    "preemption": {"kv_cache": {"block_size": 4, "num_blocks": 22}},
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_logprobs_equal_transformers(
    tiny_checkpoints: dict[str, Path], hf_llama: tuple, setup: str, overlap: bool
) -> None:
    tok = hf_llama[0]
    config = {"kv_cache": {"block_size": 4, "num_blocks": 256}, **SETUPS[setup]}
    pipe = mii_server.pipeline(str(tiny_checkpoints["llama"]), overlap_scheduling=overlap, **config)
    responses = pipe(
        PROMPTS, max_new_tokens=12, do_sample=False, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    if setup == "preemption":
        assert pipe.loop.scheduler.num_preemptions > 0
    assert pipe.loop.engine.free_blocks == pipe.loop.engine.total_blocks
    pipe.destroy()
    for prompt, r in zip(PROMPTS, responses):
        prompt_ids = tok.encode(prompt)
        expected = hf_log_softmax(hf_llama, prompt_ids + r.token_ids)
        assert len(r.logprobs) == len(r.token_ids) == 12
        for j, entry in enumerate(r.logprobs):
            assert_entry(entry, expected[len(prompt_ids) - 1 + j], r.token_ids[j], 3, tok)
            assert entry.top_logprobs[0].token_id == entry.token_id  # greedy: the most likely
        assert len(r.prompt_logprobs) == len(prompt_ids) and r.prompt_logprobs[0] is None
        for i, entry in enumerate(r.prompt_logprobs[1:], start=1):
            assert_entry(entry, expected[i - 1], prompt_ids[i], 2, tok)


def test_logprobs_are_raw_before_sampling_controls(
    tiny_checkpoints: dict[str, Path], hf_llama: tuple
) -> None:
    pipe = mii_server.pipeline(str(tiny_checkpoints["llama"]))
    controls = {"temperature": 0.5, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.5, "frequency_penalty": 1.0,
                "presence_penalty": 0.5, "logit_bias": {7: 5.0}, "min_new_tokens": 10}  # fmt: skip
    (r,) = pipe(PROMPTS[:1], max_new_tokens=10, do_sample=True, seed=5, logprobs=0, **controls)
    pipe.destroy()
    prompt_ids = hf_llama[0].encode(PROMPTS[0])
    expected = hf_log_softmax(hf_llama, prompt_ids + r.token_ids)
    for j, entry in enumerate(r.logprobs):
        assert_entry(entry, expected[len(prompt_ids) - 1 + j], r.token_ids[j], 0, hf_llama[0])
    assert r.prompt_logprobs is None


def test_stream_carries_one_entry_per_token_and_the_prompt_once(tiny_checkpoints: dict[str, Path]) -> None:
    pipe = mii_server.pipeline(str(tiny_checkpoints["llama"]))
    loop = pipe.loop
    updates: list[RequestUpdate] = []
    params = GenerateParams(max_new_tokens=6, do_sample=False, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    loop.submit(PROMPTS[0], params, updates.append, stream=True)
    plain: list[RequestUpdate] = []
    loop.submit(PROMPTS[1], GenerateParams(max_new_tokens=6, do_sample=False), plain.append, stream=True)
    while loop.has_work():
        loop.step()
    assert [len(u.response.logprobs) for u in updates] == [1] * 6
    assert [u.response.logprobs[0].token_id for u in updates] == [u.response.token_ids[0] for u in updates]
    assert updates[0].response.prompt_logprobs is not None
    assert all(u.response.prompt_logprobs is None for u in updates[1:])
    assert all(e.top_logprobs == [] for e in updates[0].response.prompt_logprobs[1:])  # k = 0
    joined = Response.join([u.response for u in updates])
    assert [e.token_id for e in joined.logprobs] == joined.token_ids
    assert joined.prompt_logprobs == updates[0].response.prompt_logprobs
    # a request that asked for nothing pays for nothing and gets None
    assert all(u.response.logprobs is None and u.response.prompt_logprobs is None for u in plain)
    pipe.destroy()


def test_message_form_round_trips_logprobs(tiny_checkpoints: dict[str, Path]) -> None:
    pipe = mii_server.pipeline(str(tiny_checkpoints["llama"]))
    (r,) = pipe(PROMPTS[:1], max_new_tokens=3, do_sample=False, logprobs=2, prompt_logprobs=1)
    pipe.destroy()
    assert Response.from_msg_dict(r.to_msg_dict()) == r
    plain = Response("x", 2, 1, r.finish_reason, [5])
    assert Response.from_msg_dict(plain.to_msg_dict()) == plain
