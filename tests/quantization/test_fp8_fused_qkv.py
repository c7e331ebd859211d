"""fp8 attention layers: q/k/v, rotary and the KV append as one op (``fp8_linear_rotary_kv_append``),
taken where an unquantized layer takes ``linear_rotary_kv_append``. Generation through it must equal
generation through the fp8 product, then ``rotary_kv_append``: with the reference ops (fp8 emulated, as
the CPU runs it), and with the Triton ops as on fp8 tensor cores, where decode's few rows run the fused
kernel (on the CPU in Triton's interpreter, ``TRITON_INTERPRET=1``, set by tests/kernels/conftest.py
when the suite runs whole). The kernel itself is checked against the same composition in
``tests/kernels/test_triton_quant.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.demo_model import build_tiny_checkpoint
from mii_server.models.llama import LlamaAttention
from mii_server.quantization import scheme

from .prequantized import write_compressed_tensors_fp8, write_fine_grained_fp8

PROMPTS = ["The list of", "A file is", "To read a", "Hello"]


@pytest.fixture(scope="module")
def wide_head_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """fp8 checkpoints whose heads are 32 wide (the fused kernel needs 16 columns of each half): a
    Llama with one fp8 scale per tensor, a Qwen2 (q/k/v with a bias) with one per channel."""
    root = tmp_path_factory.mktemp("wide_heads")
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    llama = build_tiny_checkpoint(root / "llama", "llama", seed=11, **heads)
    qwen2 = build_tiny_checkpoint(root / "qwen2", "qwen2", seed=12, **heads)
    return {
        "llama-fp8-tensor": write_fine_grained_fp8(llama, root / "llama-fp8", None),
        "qwen2-fp8-channel": write_compressed_tensors_fp8(qwen2, root / "qwen2-fp8", "FP8_DYNAMIC"),
    }


@pytest.mark.parametrize("name", ["llama-fp8-tensor", "qwen2-fp8-channel"])
@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_fused_fp8_qkv_generates_what_the_product_then_rotary_generates(
    name: str, kernels: str, wide_head_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernels == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and TRITON_INTERPRET is not set")
        monkeypatch.setenv("MII_SERVER_KERNELS", "triton")
        monkeypatch.setattr(scheme, "fp8_supported", lambda device: True)  # the fp8 tensor-core path
    launches = []
    if kernels == "triton":
        from mii_server.kernels import triton_fused_linear

        launch = triton_fused_linear._launch_qkv_rotary
        monkeypatch.setattr(triton_fused_linear, "_launch_qkv_rotary", lambda *a: launches.append(a) or launch(*a))
    pipe = mii_server.pipeline(str(wide_head_checkpoints[name]), kv_cache={"block_size": 16, "num_blocks": 64})
    layers = [m for m in pipe.runtime.loaded.model.modules() if isinstance(m, LlamaAttention)]
    assert layers and all(layer.qkv_proj.fp8 for layer in layers)
    fused = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=8, do_sample=False)]
    assert bool(launches) == (kernels == "triton")  # the decode steps ran the fused kernel
    for layer in layers:  # the product, then rotary_kv_append
        monkeypatch.setattr(layer.qkv_proj, "fp8", False)
    launches.clear()
    plain = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=8, do_sample=False)]
    assert not launches
    assert fused == plain
    pipe.destroy()
