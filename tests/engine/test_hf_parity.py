"""Greedy output equals Hugging Face transformers generate, token for token (float32, CPU)."""

from __future__ import annotations

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
def hf_outputs(tiny_checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(path, PROMPTS, NEW_TOKENS) for name, path in tiny_checkpoints.items()}


ENGINE_SETUPS = {
    "roomy": {},
    # Prompts split across forwards: at most 7 tokens per forward, at most 3 sequences.
    "split_prompts": {"max_ragged_batch_size": 7, "max_ragged_sequence_count": 3},
    # A cache too small for all five sequences at once: forces preemption and recompute.
    "preemption": {"kv_cache": {"block_size": 4, "num_blocks": 30}},
}


@pytest.mark.parametrize("setup", sorted(ENGINE_SETUPS))
@pytest.mark.parametrize("variant", ["llama", "llama3", "mistral", "qwen2"])
def test_greedy_matches_transformers(
    variant: str, setup: str, tiny_checkpoints: dict[str, Path], hf_outputs: dict[str, list[list[int]]]
) -> None:
    pipe = mii_server.pipeline(str(tiny_checkpoints[variant]), **ENGINE_SETUPS[setup])
    responses = pipe(PROMPTS, max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True)
    assert [r.token_ids for r in responses] == hf_outputs[variant]
    assert all(r.finish_reason == "length" and r.generated_length == NEW_TOKENS for r in responses)
    if setup == "preemption":
        assert pipe.loop.scheduler.num_preemptions > 0
    assert pipe.loop.engine.free_blocks == pipe.loop.engine.total_blocks  # every block returned
    pipe.destroy()
