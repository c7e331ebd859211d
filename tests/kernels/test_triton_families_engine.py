"""Whole models on the Triton ops give the reference ops' greedy tokens: the MoE router, sort and
grouped GEMMs inside Mixtral, the windowed, soft-capped attention and GeGLU inside Gemma 2, q/k/v with
rotary in one launch inside a Llama with wide heads, mixed steps whose decode rows go to the decode
kernel (and in each, the few-row LM head).

On the CPU the Triton ops run in the interpreter (``TRITON_INTERPRET=1``, set by conftest.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

import mii_server

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog."]


def _greedy_tokens_per_kernels(
    path: Path, prompts: list[str], monkeypatch: pytest.MonkeyPatch, max_new_tokens: int = 4, max_seqs: int = 3
) -> dict[str, list[list[int]]]:
    """Greedy tokens of ``prompts`` with the reference ops, then with the Triton ops. float32 on the
    CPU too, so both runs compare like with like; a small token budget splits prompts into chunks."""
    outputs = {}
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("MII_SERVER_KERNELS", kernels)
        pipe = mii_server.pipeline(
            str(path), dtype="float32", max_ragged_batch_size=16, max_ragged_sequence_count=max_seqs
        )
        responses = pipe(prompts, max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=True)
        outputs[kernels] = [r.token_ids for r in responses]
        pipe.destroy()
    return outputs


@pytest.mark.parametrize("variant", ["mixtral", "gemma2"])
def test_triton_ops_generate_what_the_reference_generates(
    variant: str, tiny_checkpoints: Mapping[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = _greedy_tokens_per_kernels(tiny_checkpoints[variant], PROMPTS, monkeypatch)
    assert outputs["triton"] == outputs["reference"]


def test_wide_heads_take_the_fused_qkv_kernel_and_generate_what_the_reference_generates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v with rotary and the KV append in one launch needs 16 columns of each half of a head, which
    the tiny models' 16-wide heads do not have: a Llama with 32-wide heads takes it at decode."""
    from mii_server.demo_model import build_tiny_checkpoint
    from mii_server.kernels import triton_fused_linear

    path = build_tiny_checkpoint(tmp_path / "llama", "llama", seed=13, num_attention_heads=2, num_key_value_heads=1)
    launches = []
    launch = triton_fused_linear._launch_qkv_rotary
    monkeypatch.setattr(triton_fused_linear, "_launch_qkv_rotary", lambda *a: launches.append(a) or launch(*a))
    outputs = _greedy_tokens_per_kernels(path, PROMPTS, monkeypatch)
    assert launches  # the decode steps of the Triton run
    assert outputs["triton"] == outputs["reference"]


def test_mixed_steps_split_their_decode_rows_and_generate_what_the_reference_generates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four short prompts decode while a long one is still being prefilled in chunks: those steps put
    four decode rows first, which with two KV heads fill four SMs (the interpreter's count, and the
    count a GPU is given here), so attention sends them to the decode kernel and the chunk to the
    ragged kernel (``paged_mixed_attention``)."""
    from mii_server.demo_model import build_tiny_checkpoint
    from mii_server.kernels import triton_attention

    path = build_tiny_checkpoint(tmp_path / "llama", "llama", seed=5)
    prompts = ["Hi", "A", "Yes", "Go", " ".join(["The quick brown fox jumps over the lazy dog."] * 4)]
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 4)
    launches = []
    mixed = triton_attention.paged_mixed_attention
    monkeypatch.setattr(triton_attention, "paged_mixed_attention", lambda *a, **k: launches.append(a) or mixed(*a, **k))
    outputs = _greedy_tokens_per_kernels(path, prompts, monkeypatch, max_new_tokens=6, max_seqs=5)
    assert launches  # the mixed steps of the Triton run
    assert outputs["triton"] == outputs["reference"]
