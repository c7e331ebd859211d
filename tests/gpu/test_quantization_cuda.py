"""Quantized models on a CUDA device (skipped without one): the Triton GEMMs, CUDA graphs included,
generate what the reference ops generate for the same quantized weights, and stay close to bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.quantization import fp8_supported

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FP8 = torch.cuda.is_available() and fp8_supported(torch.device("cuda"))
MODES = ["int8", "wf6af16", pytest.param("fp8", marks=pytest.mark.skipif(not FP8, reason="no fp8 tensor cores"))]
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head size 64 and layer widths that fill the GEMM tiles."""
    from mii_server.demo_model import build_tiny_checkpoint

    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu-quant") / "llama", "llama", seed=3, hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def generate(path: Path, **kwargs: object) -> list[list[int]]:
    kwargs.setdefault("kv_cache", {"num_blocks": 64, "block_size": 16})
    pipe = mii_server.pipeline(str(path), device="cuda", dtype="bfloat16", max_ragged_sequence_count=8, **kwargs)
    try:
        return [r.token_ids for r in pipe(PROMPTS, max_new_tokens=32, do_sample=False, ignore_eos=True)]
    finally:
        pipe.destroy()


def common_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b))
    return same / sum(len(p) for p in a)


@pytest.mark.parametrize("mode", MODES)
def test_triton_matches_reference_and_stays_near_bf16(mode: str, checkpoint: Path, monkeypatch) -> None:
    triton = generate(checkpoint, quantization_mode=mode)
    monkeypatch.setenv("MII_SERVER_KERNELS", "reference")
    reference = generate(checkpoint, quantization_mode=mode)
    monkeypatch.delenv("MII_SERVER_KERNELS")
    bf16 = generate(checkpoint)
    print(f"{mode}: triton vs reference {common_prefix(reference, triton):.2f}, vs bf16 {common_prefix(bf16, triton):.2f}")
    assert common_prefix(reference, triton) >= 0.8
    assert [t[0] for t in triton] == [b[0] for b in bf16]


@pytest.mark.skipif(not FP8, reason="no fp8 tensor cores")
@pytest.mark.parametrize("gemm", ["triton", "scaled_mm"])
def test_fp8_gemms_agree(gemm: str, checkpoint: Path, monkeypatch) -> None:
    monkeypatch.setenv("MII_SERVER_FP8_GEMM", "triton")
    triton = generate(checkpoint, quantization_mode="fp8")
    monkeypatch.setenv("MII_SERVER_FP8_GEMM", gemm)
    assert common_prefix(triton, generate(checkpoint, quantization_mode="fp8", cuda_graphs=False)) >= 0.8


@pytest.mark.skipif(not FP8, reason="no fp8 tensor cores")
def test_block_scaled_fp8_checkpoint_runs_on_the_triton_gemm(checkpoint: Path, tmp_path: Path) -> None:
    from quantization.prequantized import write_fine_grained_fp8

    fp8 = write_fine_grained_fp8(checkpoint, tmp_path / "fp8", (128, 128))
    assert common_prefix(generate(checkpoint), generate(fp8)) >= 0.3


def test_fp8_kv_cache_matches_reference(checkpoint: Path, monkeypatch) -> None:
    """Triton's rotary + cache write rounds to fp8 as torch does, and attention widens it back."""
    triton = generate(checkpoint, kv_cache={"dtype": "fp8", "num_blocks": 64, "block_size": 16})
    monkeypatch.setenv("MII_SERVER_KERNELS", "reference")
    reference = generate(checkpoint, kv_cache={"dtype": "fp8", "num_blocks": 64, "block_size": 16})
    assert common_prefix(reference, triton) >= 0.8
