"""Triton twins of the ops the models call from ``reference``, with identical signatures and semantics.

``mii_server.kernels.get_ops`` returns this module on CUDA when Triton imports. The kernels live in
``triton_pointwise`` (RMSNorm, SiLU-and-mul, rotary embedding fused with the KV append) and ``triton_attention``
(ragged paged attention: a split-K decode kernel and a ragged prefill kernel behind one dispatch).
"""

from __future__ import annotations

from .triton_attention import paged_attention
from .triton_pointwise import rms_norm, rotary_kv_append, silu_and_mul

__all__ = ["paged_attention", "rms_norm", "rotary_kv_append", "silu_and_mul"]
