"""Pure-PyTorch reference ops: the CPU path and the oracle for every Triton kernel.

The ops the models call (``rms_norm``, ``silu_and_mul``, ``gelu_tanh_and_mul``, ``rotary_kv_append``,
``kv_append``, ``paged_attention``, ``moe_route``, ``fused_moe``, and the quantized linears of
``reference_quant``: ``int8_linear``, ``fp6_linear``, ``fp8_linear``) have twins with the same signatures
in ``triton_ops`` (when Triton is present); ``mii_server.kernels`` dispatches between the two.
``rotary_embedding`` and ``kv_append`` are the halves of ``rotary_kv_append``, kept apart as the readable
definitions. Shapes: T tokens in the flat ragged batch,
S sequences, Hq query heads, Hk key/value heads, D head size, B cache blocks of ``block_size`` slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata
from .reference_quant import Fp8Rows, fp6_linear, fp8_linear, int8_linear, quantize_fp8_per_token

__all__ = [
    "argmax_rows", "dense_linear", "fp6_linear", "fp8_linear", "fp8_linear_gelu_tanh_and_mul",
    "fp8_linear_rotary_kv_append", "fp8_linear_silu_and_mul", "gelu_tanh_and_mul", "gelu_tanh_and_mul_fp8",
    "int8_linear", "kv_append", "linear_gelu_tanh_and_mul",
    "linear_rotary_kv_append", "linear_silu_and_mul", "logits_linear", "paged_attention",
    "quantize_fp8_per_token", "rms_norm", "rms_norm_fp8", "rotary_embedding", "rotary_kv_append",
    "silu_and_mul", "silu_and_mul_fp8", "split_qkv",
]  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional fused residual add.

    x: [T, H]; residual: [T, H] or None. Returns (normed [T, H], the new residual stream [T, H]):
    with a residual, the stream is ``x + residual``; without one it is ``x`` itself.
    """
    stream = x if residual is None else x + residual
    h = stream.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h.to(x.dtype) * weight).to(x.dtype), stream


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Fp8Rows, torch.Tensor]:
    """``rms_norm`` whose normed rows come quantized for the fp8 linear that reads them:
    (``Fp8Rows`` of the normed [T, H] rows, the new residual stream)."""
    normed, stream = rms_norm(x, weight, eps, residual)
    return _fp8_rows(normed), stream


def _fp8_rows(y: torch.Tensor) -> Fp8Rows:
    """y [..., K] as [T, K] rows quantized per token, for the fp8 linear that reads them."""
    return Fp8Rows(*quantize_fp8_per_token(y.reshape(-1, y.shape[-1])), y.dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [S, V] float -> int64 [S], the first column of each row's maximum (NaN above every number)."""
    return x.argmax(dim=-1)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] in x's dtype (an unquantized linear without bias)."""
    return F.linear(x, weight)


def logits_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head: x [T, K] @ weight [N, K]^T -> float32 [T, N], the product rounded to x's dtype
    first (as transformers computes logits in the model's dtype; the sampler reads float32).
    ``scale`` [N, 1]: the weight is int8 (``int8_linear``'s product)."""
    product = F.linear(x, weight) if scale is None else int8_linear(x, weight, scale)
    return product.float()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up projections -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): x: [T, 2I] holding gate then up -> gelu_tanh(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """``silu_and_mul`` whose [T, I] rows come quantized per token for the fp8 linear that reads them."""
    return _fp8_rows(silu_and_mul(x))


def gelu_tanh_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """``gelu_tanh_and_mul``, its rows quantized per token for an fp8 linear."""
    return _fp8_rows(gelu_tanh_and_mul(x))


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A gated MLP's gate and up projections and its activation: ``silu_and_mul(x @ weight^T)``,
    weight [2I, K] holding the gate rows, then the up rows (one launch on the GPU for few rows)."""
    return silu_and_mul(dense_linear(x, weight))


def linear_gelu_tanh_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh_and_mul(x @ weight^T)``, as ``linear_silu_and_mul``."""
    return gelu_tanh_and_mul(dense_linear(x, weight))


def fp8_linear_silu_and_mul(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, gemm: str = "auto"
) -> torch.Tensor:
    """``linear_silu_and_mul`` with an fp8 weight: ``silu_and_mul(fp8_linear(x, weight, scale))``, rows
    in the model dtype (x quantized per token, or given as ``Fp8Rows``). The Triton twin does it in one
    launch at one row, where the model calls it: its fp8 down projection then quantizes that row as
    it reads it, two launches fewer than the product, ``silu_and_mul_fp8`` and the down GEMM."""
    return silu_and_mul(fp8_linear(x, weight, scale, None, gemm))


def fp8_linear_gelu_tanh_and_mul(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, gemm: str = "auto"
) -> torch.Tensor:
    """``gelu_tanh_and_mul(fp8_linear(x, weight, scale))``, as ``fp8_linear_silu_and_mul``."""
    return gelu_tanh_and_mul(fp8_linear(x, weight, scale, None, gemm))


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding in the rotate-half (GPT-NeoX / Hugging Face Llama) layout.

    q: [T, Hq, D]; k: [T, Hk, D]; positions: int64[T];
    cos_sin_cache: float32[max_positions, R] holding cos of the R/2 frequencies then their sin. R is
    the rotary width: R = D rotates whole heads; R < D (partial rotary, Phi) rotates the first R
    dimensions of each head and passes the other D - R through unchanged.
    Returns rotated (q, k) in the input dtype.
    """
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cos_sin = cos_sin_cache.index_select(0, positions)  # [T, R]
    cos = cos_sin[:, :half].unsqueeze(1)  # [T, 1, R/2]
    sin = cos_sin[:, half:].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2, rest = x.float()[..., :half], x.float()[..., half:rot], x.float()[..., rot:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def kv_append(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its cache slot, in place.

    k, v: [T, Hk, D]; k_cache, v_cache: [B, block_size, Hk, D]; slot_mapping: int64[T]. A negative
    slot (a padding token of a CUDA-graph batch) writes nothing.
    """
    keep = slot_mapping >= 0
    k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def rotary_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """A layer's step between its q/k/v projection and attention: rotate q and k
    (``rotary_embedding``), write the rotated k and v into their cache slots (``kv_append``) and
    return the rotated q [T, Hq, D]. The Triton twin does all of it in one launch."""
    q, k = rotary_embedding(q, k, positions, cos_sin_cache)
    kv_append(k, v, k_cache, v_cache, slot_mapping)
    return q


def linear_rotary_kv_append(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """An attention layer from its normed input to attention's q: the packed q/k/v product
    ``x @ weight^T + bias`` (weight rows: the Hq query heads, then the Hk key heads, then the Hk value
    heads, D each; Hk and D read from ``k_cache``), then ``rotary_kv_append``. Returns the rotated q
    [T, Hq, D]. The Triton twin does it in one launch for decode's few rows."""
    qkv = F.linear(x, weight, bias)
    return _packed_rotary_kv_append(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def fp8_linear_rotary_kv_append(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    gemm: str = "auto",
) -> torch.Tensor:
    """``linear_rotary_kv_append`` with an fp8 weight: ``fp8_linear`` (x quantized per token, or given
    as ``Fp8Rows``), then ``rotary_kv_append``. The Triton twin does it in one launch for decode's few
    rows."""
    qkv = fp8_linear(x, weight, scale, bias, gemm)
    return _packed_rotary_kv_append(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def _packed_rotary_kv_append(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """A packed q/k/v product [T, (Hq + 2 Hk) D] through ``rotary_kv_append``; returns q."""
    q, k, v = split_qkv(qkv, k_cache.shape[2], k_cache.shape[3])
    return rotary_kv_append(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def split_qkv(qkv: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """A packed q/k/v product [T, (Hq + 2 Hk) D] as (q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]), views of
    it where its layout allows."""
    heads = qkv.reshape(qkv.shape[0], -1, head_dim)
    return heads.split([heads.shape[1] - 2 * num_kv_heads, num_kv_heads, num_kv_heads], dim=1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a ragged batch (prefill chunks and decode tokens together) over the cache.

    q: [T, Hq, D]; k_cache, v_cache: [B, block_size, Hk, D] already holding this batch's keys and
    values (``rotary_kv_append`` runs first). Grouped-query attention: query head h reads KV head
    h // (Hq // Hk). Returns [T, Hq, D] in q's dtype.

    ``sliding_window`` W > 0: the token at position i sees keys at positions i - W + 1 .. i only
    (Hugging Face's ``kv_idx > q_idx - sliding_window``). ``logit_softcap`` c > 0 (Gemma 2): the scaled
    logits s become c * tanh(s / c) before the mask and the softmax.

    Sequences with one new token (decode) are attended together in one batched product; sequences
    with several (prefill chunks) one at a time.
    """
    out = torch.empty_like(q)
    cu = meta.cu_q_lens.tolist()
    ctx = meta.context_lens.tolist()
    decode = [s for s in range(len(ctx)) if cu[s + 1] - cu[s] == 1]
    if decode:
        rows = torch.tensor(decode, device=q.device)
        tokens = meta.cu_q_lens.long()[rows]  # each decode sequence's one token
        out[tokens] = _decode_attention(
            q[tokens], k_cache, v_cache, meta.block_table[rows], meta.context_lens[rows], scale,
            sliding_window, logit_softcap,
        )  # fmt: skip
    for s in range(len(ctx)):
        start, end = cu[s], cu[s + 1]
        if end - start > 1:
            out[start:end] = _chunk_attention(
                q[start:end], k_cache, v_cache, meta.block_table[s], ctx[s], scale,
                sliding_window, logit_softcap,
            )  # fmt: skip
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, group: int) -> torch.Tensor:
    """The cache rows of ``blocks`` ([..., n]) as float32 [..., n * block_size, Hq, D] (KV heads
    repeated for their query-head group)."""
    rows = cache[blocks.long()]  # [..., n, block_size, Hk, D]
    rows = rows.reshape(*blocks.shape[:-1], -1, *cache.shape[2:])
    return rows.float().repeat_interleave(group, dim=-2)


def _attend(
    q: torch.Tensor,  # float32 [..., L, D]
    keys: torch.Tensor,  # float32 [..., C, D]
    values: torch.Tensor,
    visible: torch.Tensor,  # bool, broadcast to [..., L, C]
    scale: float,
    logit_softcap: float,
) -> torch.Tensor:
    if not logit_softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
    logits = q @ keys.transpose(-1, -2) * scale  # [..., L, C]
    logits = torch.tanh(logits / logit_softcap) * logit_softcap
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1) @ values


def _decode_attention(
    q: torch.Tensor,  # [S, Hq, D]: one query per sequence, at position context_len - 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [S, max_blocks]
    context_lens: torch.Tensor,  # [S]
    scale: float,
    sliding_window: int,
    logit_softcap: float,
) -> torch.Tensor:
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    n_blocks = -(-int(context_lens.max()) // k_cache.shape[1])
    blocks = block_table[:, :n_blocks].long()
    keys = k_cache[blocks].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)  # [S, Hk, C, D]
    values = v_cache[blocks].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # A KV head's group of query heads act as that head's "query positions": [S, Hk, group, D]
    queries = q.reshape(num_seqs, num_kv_heads, -1, head_dim)
    key_pos = torch.arange(keys.shape[2], device=q.device)[None, :]
    visible = key_pos < context_lens[:, None]  # [S, C]
    if sliding_window:
        visible &= key_pos >= context_lens[:, None] - sliding_window
    out = _attend(
        queries.float(), keys.float(), values.float(), visible[:, None, None, :], scale, logit_softcap
    )  # [S, Hk, group, D]
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


def _chunk_attention(
    q: torch.Tensor,  # [L, Hq, D]: the last L positions of a context of context_len tokens
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,  # [max_blocks]
    context_len: int,
    scale: float,
    sliding_window: int,
    logit_softcap: float,
) -> torch.Tensor:
    group = q.shape[1] // k_cache.shape[2]
    n_blocks = -(-context_len // k_cache.shape[1])
    keys = _gather(k_cache, blocks[:n_blocks], group)[:context_len].transpose(0, 1)  # [Hq, C, D]
    values = _gather(v_cache, blocks[:n_blocks], group)[:context_len].transpose(0, 1)
    q_positions = torch.arange(context_len - q.shape[0], context_len, device=q.device)[:, None]  # [L, 1]
    key_pos = torch.arange(context_len, device=q.device)[None, :]  # [1, C]
    visible = key_pos <= q_positions  # [L, C]
    if sliding_window:
        visible &= key_pos > q_positions - sliding_window
    out = _attend(q.float().transpose(0, 1), keys, values, visible, scale, logit_softcap)
    return out.transpose(0, 1).to(q.dtype)  # [L, Hq, D]


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a mixture-of-experts layer: softmax over all experts in float32, each token's
    ``top_k`` most probable experts, their probabilities renormalised to sum to 1 when ``normalize``.

    router_logits: [T, E]. Returns (float32 weights [T, k], int64 expert ids [T, k]), descending.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    # why a stable sort, not topk: equal probabilities (equal half-precision logits) go to the lower
    # expert id, as the Triton router picks them; CUDA's topk orders ties arbitrarily
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts SwiGLU MLP: each token's output is the routing-weighted sum of its top-k
    experts' ``down(silu(gate(x)) * up(x))``.

    x: [T, H]; w13: [E, 2I, H] (each expert's gate rows, then its up rows); w2: [E, H, I];
    topk_weights: float [T, k]; topk_ids: int [T, k] (expert of each of a token's k slots).
    Returns [T, H] in x's dtype.

    Done as the field does it: the T * k (token, expert) slots are sorted by expert and each
    expert's two GEMMs run once over its group of tokens (here a loop over the experts, not over
    tokens). A slot's result is weighted in float32 and rounded, then each token's k slots are summed.
    """
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [T*k]: expert of slot t * k + j
    order = torch.argsort(flat, stable=True)  # slots grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1, 1).float()  # [T*k, 1]
    out = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]  # [n]
        start += n
        h = silu_and_mul(F.linear(x[slots // top_k], w13[expert]))  # [n, I]
        y = F.linear(h, w2[expert])  # [n, H]
        out[slots] = (y.float() * weights[slots]).to(x.dtype)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
