"""The new families on a CUDA device (skipped without one): a Mixtral-like MoE and a Gemma 2 with a
sliding window, small but with GPU-sized heads. Decode CUDA graphs (which capture the MoE router,
sort and grouped GEMMs) replay what the eager forward computes, the Triton engine generates what the
reference engine generates, and both follow transformers on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_cuda import PROMPTS, agreement, engine_of, generate

import mii_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
VARIANTS = {
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 64,
            "sliding_window": 16,
            "query_pre_attn_scalar": 64,
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 5.0,
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mii_server.demo_model import build_tiny_checkpoint

    model_type, overrides = VARIANTS[request.param]
    return build_tiny_checkpoint(tmp_path_factory.mktemp("gpu") / request.param, model_type, seed=5,
                                 **SHAPE, **overrides)  # fmt: skip


def _pipe(checkpoint: Path, dtype: str = "float32") -> object:
    return mii_server.pipeline(str(checkpoint), device="cuda", dtype=dtype, max_ragged_sequence_count=8,
                               kv_cache={"num_blocks": 64, "block_size": 16})  # fmt: skip


def test_graphs_on_and_off_give_the_same_greedy_tokens(checkpoint: Path) -> None:
    pipe = _pipe(checkpoint)
    engine = engine_of(pipe)
    assert engine.cuda_graphs is not None
    with_graphs = generate(pipe)
    engine.use_cuda_graphs = False
    eager = generate(pipe)
    pipe.destroy()
    assert with_graphs == eager


def test_triton_engine_follows_the_reference_and_transformers(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    outputs = {}
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("MII_SERVER_KERNELS", kernels)
        pipe = _pipe(checkpoint)
        outputs[kernels] = generate(pipe)
        pipe.destroy()
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    # why eager: transformers' own advice for Gemma 2, whose attention soft-cap its fused kernels lack
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    model = model.cuda().eval()
    # The oracle is transformers' full forward over each sequence we wrote: every token we chose must be
    # its argmax there. Not its generate(): with Gemma 2's sliding-window cache, transformers 5.17 and
    # 5.24 generate a token their own full forward does not pick (a 27-token prompt, window 16).
    hf = []
    for prompt, ours in zip(PROMPTS, outputs["triton"]):
        ids = tok.encode(prompt)
        with torch.no_grad():
            logits = model(torch.tensor([ids + ours], device="cuda")).logits[0]
        hf.append(logits[len(ids) - 1 : -1].argmax(-1).tolist())
    assert agreement(outputs["reference"], outputs["triton"]) >= 0.98
    assert agreement(hf, outputs["triton"]) >= 0.98
