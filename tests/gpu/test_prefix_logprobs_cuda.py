"""Issue 16's engine features on a CUDA device with the Triton kernels and decode CUDA graphs
(skipped without one): prefix caching on and off give the same greedy tokens (the prefill kernel
attends to cached blocks), log-probabilities equal transformers', and penalties counted on the
device agree between overlapped and synchronous steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mii_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHARED = "The quick brown fox jumps over the lazy dog. A model server answers requests for text. " * 3
PROMPTS = [SHARED + tail for tail in ["Hello", "Numbers 0 1 2 3", "café 東京", "Deployments have", "a", ""]]
CONFIG = {"device": "cuda", "dtype": "float32", "max_ragged_batch_size": 64, "max_ragged_sequence_count": 8,
          "kv_cache": {"num_blocks": 256, "block_size": 16}}  # fmt: skip
GREEDY = {"max_new_tokens": 24, "do_sample": False, "ignore_eos": True}


def test_prefix_caching_on_and_off_agree(checkpoint: Path) -> None:
    outputs = {}
    for caching in (False, True):
        pipe = mii_server.pipeline(str(checkpoint), enable_prefix_caching=caching, **CONFIG)
        first = pipe(PROMPTS, **GREEDY)
        second = pipe(PROMPTS[::-1], **GREEDY)  # every prefix is cached by now
        outputs[caching] = [r.token_ids for r in first + second]
        cached = pipe.loop.stats().cached_prompt_tokens
        assert (cached > 0) == caching
        assert all(r.cached_tokens > 0 for r in second) == caching
        pipe.destroy()
    assert outputs[True] == outputs[False]


def test_logprobs_equal_transformers_on_cuda(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pipe = mii_server.pipeline(str(checkpoint), **CONFIG)
    responses = pipe(PROMPTS[:3], logprobs=5, prompt_logprobs=5, **GREEDY)
    pipe.destroy()
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    for prompt, r in zip(PROMPTS, responses):
        ids = tok.encode(prompt)
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([ids + r.token_ids])).logits[0], dim=-1)
        got = [e.logprob for e in r.prompt_logprobs[1:]] + [e.logprob for e in r.logprobs]
        want = [expected[i - 1, t].item() for i, t in enumerate(ids + r.token_ids) if i > 0]
        assert got == pytest.approx(want[: len(got)], abs=1e-3)
        assert [t.token_id for t in r.logprobs[0].top_logprobs] == expected[len(ids) - 1].topk(5).indices.tolist()


def test_penalties_overlap_equals_sync_with_graphs(checkpoint: Path) -> None:
    controls = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {5: 1.0}}
    outputs = []
    for overlap in (True, False):
        pipe = mii_server.pipeline(str(checkpoint), overlap_scheduling=overlap, **CONFIG)
        assert pipe.runtime.engine.cuda_graphs is not None
        outputs.append([r.token_ids for r in pipe(PROMPTS, **GREEDY, **controls)])
        pipe.destroy()
    assert outputs[0] == outputs[1]
