"""Triton twins of every op in ``reference``, with identical signatures and semantics.

``mii_server.kernels.get_ops`` returns this module on CUDA when Triton imports. The kernels live in
``triton_pointwise`` (RMSNorm, SiLU-and-mul, rotary embedding, KV append), ``triton_attention``
(ragged paged attention: a split-K decode kernel and a ragged prefill kernel behind one dispatch)
and ``triton_linear`` (the weight-streaming matmul of decode steps of up to 16 rows).
"""

from __future__ import annotations

from .triton_attention import paged_attention
from .triton_linear import linear
from .triton_pointwise import kv_append, rms_norm, rotary_embedding, silu_and_mul

__all__ = ["kv_append", "linear", "paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul"]
