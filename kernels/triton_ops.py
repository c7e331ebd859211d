"""Triton twins of the ops the models call from ``reference``, with identical signatures and semantics.

``mii_server.kernels.get_ops`` returns this module on CUDA when Triton imports. The kernels live in
``triton_pointwise`` (RMSNorm, SiLU/GELU-and-mul, rotary embedding fused with the KV append, the plain
KV append), ``triton_attention`` (ragged paged attention: a split-K decode kernel and a ragged prefill
kernel behind one dispatch, with sliding windows and logit soft-capping) and ``triton_moe`` (the fused
mixture-of-experts router and MLP: tokens sorted by expert, one grouped GEMM per projection).
"""

from __future__ import annotations

from .triton_attention import paged_attention
from .triton_moe import fused_moe, moe_route
from .triton_pointwise import gelu_tanh_and_mul, kv_append, rms_norm, rotary_kv_append, silu_and_mul

__all__ = [
    "fused_moe",
    "gelu_tanh_and_mul",
    "kv_append",
    "moe_route",
    "paged_attention",
    "rms_norm",
    "rotary_kv_append",
    "silu_and_mul",
]
