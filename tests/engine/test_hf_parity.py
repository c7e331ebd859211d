"""Greedy output equals Hugging Face transformers generate, token for token (float32, CPU)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

import mii_server

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "A model server answers requests for text; ragged batching packs many sequences",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, and multilingual text: café, 東京, 🙂",
    "Deployments",
]
NEW_TOKENS = 24
# the families beyond Llama's first three (tests/conftest.py's TINY_VARIANTS)
FAMILIES = [
    "mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "phi", "falcon", "falcon_7b", "falcon_sequential",
    "opt", "gemma2",
]  # fmt: skip


def hf_greedy(path: Path, prompts: list[str], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # like ignore_eos: compare a fixed number of tokens
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


@pytest.fixture(scope="module")
def hf_outputs(tiny_checkpoints: Mapping[str, Path]) -> Callable[[str], list[list[int]]]:
    """variant -> transformers' greedy tokens for PROMPTS (computed once per variant)."""
    return functools.cache(lambda name: hf_greedy(tiny_checkpoints[name], PROMPTS, NEW_TOKENS))


ENGINE_SETUPS = {
    "roomy": {},
    # Prompts split across forwards: at most 7 tokens per forward, at most 3 sequences.
    "split_prompts": {"max_ragged_batch_size": 7, "max_ragged_sequence_count": 3},
    # A cache too small for all five sequences at once: forces preemption and recompute.
    "preemption": {"kv_cache": {"block_size": 4, "num_blocks": 30}},
}
# every engine setup for the first families; one forward of whole prompts for the others, and split
# prompts too where a sliding window makes a prompt chunk's context matter
ENGINE_CASES = [
    *((variant, setup) for variant in ("llama", "llama3", "mistral", "qwen2") for setup in sorted(ENGINE_SETUPS)),
    *((variant, "roomy") for variant in FAMILIES),
    ("phi3", "split_prompts"),
    ("gemma2", "split_prompts"),
]


@pytest.mark.parametrize(("variant", "setup"), ENGINE_CASES)
def test_greedy_matches_transformers(
    variant: str, setup: str, tiny_checkpoints: Mapping[str, Path], hf_outputs: Callable[[str], list[list[int]]]
) -> None:
    pipe = mii_server.pipeline(str(tiny_checkpoints[variant]), **ENGINE_SETUPS[setup])
    responses = pipe(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True)
    assert [r.token_ids for r in responses] == hf_outputs(variant)
    assert all(r.finish_reason == "length" and r.generated_length == NEW_TOKENS for r in responses)
    if setup == "preemption":
        assert pipe.loop.scheduler.num_preemptions > 0
    assert pipe.loop.engine.free_blocks == pipe.loop.engine.total_blocks  # every block returned
    pipe.destroy()


@pytest.mark.parametrize("variant", FAMILIES)
def test_logits_match_transformers(variant: str, tiny_checkpoints: Mapping[str, Path]) -> None:
    """The last position's logits of a prompt longer than any test window, and of one decode step
    after it, equal transformers' (greedy tokens cannot see e.g. Gemma 2's final soft-cap)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoints[variant]
    ids = AutoTokenizer.from_pretrained(str(path)).encode(PROMPTS[3])  # 55 tokens
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([ids + [7]])).logits[0, -2:]  # [2, vocab]
    pipe = mii_server.pipeline(str(path))
    engine = pipe.loop.engine
    prefill = engine.put([0], [ids])  # [1, vocab]
    decode = engine.put([0], [[7]])
    pipe.destroy()
    torch.testing.assert_close(torch.cat([prefill, decode]), expected, atol=1e-4, rtol=1e-4)
