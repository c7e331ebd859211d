"""The engine with FlashAttention-4 taking prompt attention (skipped without a Hopper GPU and the
optional flash-attn-4 package): the prompt's log-probabilities match the Triton kernel's, in the same
dtype, to within rounding, on fresh prompts and on prompts whose prefix the cache already holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.kernels import fa4_attention

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="FlashAttention-4 is used on Hopper GPUs")

# about 800 tokens each (the checkpoint holds 1,024 positions), over 2,000 in the first step
SHARED = "A model server answers requests for text; ragged batching packs many sequences. " * 20
PROMPTS = [SHARED + "Hello there", SHARED + "Numbers 0 1 2 3 4 5", "The quick brown fox " * 60]
CONFIG = {"device": "cuda", "dtype": "bfloat16", "max_ragged_batch_size": 4096, "max_ragged_sequence_count": 8,
          "kv_cache": {"num_blocks": 256, "block_size": 64}}  # fmt: skip


def prompt_logprobs(checkpoint: Path, kernels: str, monkeypatch: pytest.MonkeyPatch) -> list[list[float]]:
    monkeypatch.setenv(fa4_attention.PREFILL_ATTENTION_ENV, kernels)
    pipe = mii_server.pipeline(str(checkpoint), **CONFIG)
    try:
        # twice: the second pass finds every shared prefix cached and prefills only the rest
        out = []
        for _ in range(2):
            responses = pipe(PROMPTS, max_new_tokens=1, prompt_logprobs=1, do_sample=False)
            out += [[e.logprob for e in r.prompt_logprobs[1:]] for r in responses]
        return out
    finally:
        pipe.destroy()


def test_prompt_logprobs_match_the_triton_kernel(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("flash_attn.cute", reason="the optional flash-attn-4 package")
    from transformers import AutoTokenizer

    tokens = sum(len(AutoTokenizer.from_pretrained(str(checkpoint)).encode(p)) for p in PROMPTS)
    assert tokens >= fa4_attention.MIN_PROMPT_TOKENS  # so the first step's prompts go to FlashAttention-4
    fa4 = prompt_logprobs(checkpoint, "flash_attn_4", monkeypatch)
    triton = prompt_logprobs(checkpoint, "triton", monkeypatch)
    diffs = torch.tensor([abs(a - b) for x, y in zip(fa4, triton) for a, b in zip(x, y)])
    assert [len(x) for x in fa4] == [len(y) for y in triton]
    # two bf16 kernels round their probabilities differently; a wrong mask or a missed block is far off
    assert diffs.mean().item() < 0.01 and diffs.max().item() < 0.1, (diffs.mean().item(), diffs.max().item())
