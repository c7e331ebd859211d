"""fp8 layers: the RMSNorm before an fp8 linear hands it rows already quantized (``rms_norm_fp8``),
and so does a gated MLP's activation before its down projection (``silu_and_mul_fp8``; at one row,
the gate_up product and activation in one op, ``fp8_linear_silu_and_mul``, whose row the down
projection quantizes itself).

On fp8 tensor cores ``quantize_linears`` turns this on for every block whose norm feeds one fp8 linear
alone; on the CPU (fp8 emulated by the reference ops) it stays off, so here it is switched on by hand
and must change nothing: the fused op is, by definition, the norm followed by the per-token quantizer.
The Triton kernel is checked against the same definition in ``tests/kernels/test_triton_quant.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

import mii_server
from mii_server.kernels import reference, reference_quant
from mii_server.models import load_model
from mii_server.models.layers import RMSNorm
from mii_server.models.llama import LlamaDecoderLayer, LlamaMLP

PROMPTS = ["The list of", "A file is", "To read a", "Hello"]


def _norm_consumers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    return [pair for m in model.modules() if isinstance(m, LlamaDecoderLayer) for pair in m.norm_consumers()]


def test_emulated_fp8_keeps_plain_norms_and_fused_norms_change_nothing(prequantized_checkpoints) -> None:
    path, _ = prequantized_checkpoints["hf-fp8-tensor"]
    pipe = mii_server.pipeline(str(path), kv_cache={"block_size": 16, "num_blocks": 64})
    model = pipe.runtime.loaded.model
    pairs = _norm_consumers(model)
    assert len(pairs) == 2 * model.spec.num_layers  # each block: input norm -> qkv, post norm -> gate_up
    mlps = [m for m in model.modules() if isinstance(m, LlamaMLP)]
    assert len(mlps) == model.spec.num_layers and all(m.activation_consumer() is m.down_proj for m in mlps)
    assert not any(norm.fp8_output for norm, _ in pairs)  # emulated: off
    assert not any(m.fp8_activation for m in mlps)
    def generate() -> list[list[int]]:  # a batch, and one prompt alone (its decode steps are one row)
        return [r.token_ids for r in [*pipe(PROMPTS, max_new_tokens=8, do_sample=False),
                                      *pipe(PROMPTS[:1], max_new_tokens=8, do_sample=False)]]  # fmt: skip

    plain = generate()
    for norm, _ in pairs:
        norm.fp8_output = True
    for mlp in mlps:
        mlp.fp8_activation = True
    assert generate() == plain
    pipe.destroy()


def test_blocks_whose_norm_feeds_more_than_one_linear_keep_it_plain(tiny_checkpoints: dict[str, Path]) -> None:
    """An MoE block's post-attention norm feeds the router and the experts; Gemma 2 has its own forward."""
    moe = load_model(tiny_checkpoints["mixtral"], "float32", torch.device("cpu")).model
    assert [id(n) for n, _ in _norm_consumers(moe)] == [id(layer.input_layernorm) for layer in moe.layers]
    gemma = load_model(tiny_checkpoints["gemma2"], "float32", torch.device("cpu")).model
    assert _norm_consumers(gemma) == []


def test_fp8_linear_takes_rows_quantized_by_the_norm() -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    weight = 1 + 0.1 * torch.randn(64)
    rows, stream = reference.rms_norm_fp8(x, weight, 1e-6, residual)
    normed, want_stream = reference.rms_norm(x, weight, 1e-6, residual)
    assert isinstance(rows, reference_quant.Fp8Rows) and rows.shape == (5, 64) and rows.dtype == torch.float32
    torch.testing.assert_close(stream, want_stream, atol=0, rtol=0)
    w8 = torch.randn(32, 64).to(torch.float8_e4m3fn)
    w_scale = torch.rand(32, 1) + 0.5
    got = reference_quant.fp8_linear(rows, w8, w_scale)
    torch.testing.assert_close(got, reference_quant.fp8_linear(normed, w8, w_scale), atol=0, rtol=0)
    assert RMSNorm(64, 1e-6, torch.float32, reference).fp8_output is False  # plain unless quantization says
