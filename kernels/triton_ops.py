"""Triton twins of the ops the models call from ``reference``, with identical signatures and semantics.

``mii_server.kernels.get_ops`` returns this module on CUDA when Triton imports. The kernels live in
``triton_pointwise`` (RMSNorm, SiLU/GELU-and-mul, rotary embedding fused with the KV append, the plain
KV append), ``triton_attention`` (ragged paged attention: a split-K decode kernel and a ragged prefill
kernel behind one dispatch, with sliding windows and logit soft-capping), ``triton_moe`` (the fused
mixture-of-experts router and MLP: tokens sorted by expert, one grouped GEMM per projection),
``triton_quant`` (int8 and FP6 weight-only GEMMs, and the few-row dense GEMM and LM head),
``triton_fused_linear`` (a gated MLP's gate and up products with the activation in their epilogue, and
q/k/v with rotary and the KV append in theirs), ``triton_fp8`` (fp8 activation quantization and GEMMs)
and ``triton_argmax`` (the sampler's row-wise argmax, spread over the GPU).
"""

from __future__ import annotations

from .triton_argmax import argmax_rows
from .triton_attention import paged_attention
from .triton_fp8 import fp8_linear, quantize_fp8_per_token
from .triton_fused_linear import (
    fp8_linear_gelu_tanh_and_mul,
    fp8_linear_rotary_kv_append,
    fp8_linear_silu_and_mul,
    linear_gelu_tanh_and_mul,
    linear_rotary_kv_append,
    linear_silu_and_mul,
)
from .triton_moe import fused_moe, moe_route
from .triton_pointwise import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_fp8,
    kv_append,
    rms_norm,
    rms_norm_fp8,
    rotary_kv_append,
    silu_and_mul,
    silu_and_mul_fp8,
)
from .triton_quant import dense_linear, fp6_linear, int8_linear, logits_linear

__all__ = [
    "argmax_rows",
    "dense_linear",
    "fp6_linear",
    "fp8_linear",
    "fp8_linear_gelu_tanh_and_mul",
    "fp8_linear_rotary_kv_append",
    "fp8_linear_silu_and_mul",
    "fused_moe",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_fp8",
    "int8_linear",
    "kv_append",
    "linear_gelu_tanh_and_mul",
    "linear_rotary_kv_append",
    "linear_silu_and_mul",
    "logits_linear",
    "moe_route",
    "paged_attention",
    "quantize_fp8_per_token",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_kv_append",
    "silu_and_mul",
    "silu_and_mul_fp8",
]
