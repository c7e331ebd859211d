"""Pure-PyTorch reference ops: the CPU path and the oracle for every Triton kernel.

Every function here has a twin with the same signature in ``triton_ops`` (when Triton is present);
``mii_server.kernels`` dispatches between the two. Shapes: T tokens in the flat ragged batch,
S sequences, Hq query heads, Hk key/value heads, D head size, B cache blocks of ``block_size`` slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up projections -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding in the rotate-half (GPT-NeoX / Hugging Face Llama) layout.

    q: [T, Hq, D]; k: [T, Hk, D]; positions: int64[T];
    cos_sin_cache: float32[max_positions, D] holding cos of the D/2 frequencies then their sin.
    Returns rotated (q, k) in the input dtype.
    """
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)  # [T, D]
    cos = cos_sin[:, :half].unsqueeze(1)  # [T, 1, D/2]
    sin = cos_sin[:, half:].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def kv_append(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its cache slot, in place.

    k, v: [T, Hk, D]; k_cache, v_cache: [B, block_size, Hk, D]; slot_mapping: int64[T].
    """
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a ragged batch (prefill chunks and decode tokens together) over the cache.

    q: [T, Hq, D]; k_cache, v_cache: [B, block_size, Hk, D] already holding this batch's keys and
    values (``kv_append`` runs first). Grouped-query attention: query head h reads KV head
    h // (Hq // Hk). Returns [T, Hq, D] in q's dtype.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = meta.cu_q_lens.tolist()
    ctx = meta.context_lens.tolist()
    for s in range(len(ctx)):
        start, end, context_len = cu[s], cu[s + 1], ctx[s]
        if end == start:
            continue
        n_blocks = (context_len + block_size - 1) // block_size
        blocks = meta.block_table[s, :n_blocks].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len]  # [C, Hk, D]
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len]
        keys = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, C, D]
        values = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[start:end].float().transpose(0, 1)  # [Hq, L, D]
        scores = torch.matmul(queries, keys.transpose(1, 2)) * scale  # [Hq, L, C]
        q_positions = torch.arange(context_len - (end - start), context_len, device=q.device)
        k_positions = torch.arange(context_len, device=q.device)
        causal = k_positions[None, :] <= q_positions[:, None]  # [L, C]
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, values).transpose(0, 1).to(q.dtype)
    return out
