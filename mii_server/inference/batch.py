"""Hugging Face-shaped inputs -> the ragged batch our kernels read (``AttentionMetadata`` over a KVPool).

``generate`` feeds a padded ``[B, L]`` block of new tokens with a 2D attention mask (1 = real token,
0 = padding) and position ids. A padding column takes no KV slot and attends nothing: only real
tokens enter the flat ragged batch.

- ``prefill_metadata`` (any L): reads the rows' token counts back to the host once (the flat batch's
  length is a shape), packs the real tokens row by row and advances the rows' lengths.
- ``decode_metadata`` (L = 1): never leaves the device, so it runs inside a CUDA graph. Every row keeps
  its one token; a padding token (mask 0) writes no slot, and its output is meaningless, as in
  transformers. The attention split is fixed by the pool's capacity, not the context reached.
"""

from __future__ import annotations

import torch

from ..errors import CapacityExceeded, InvalidRequest
from ..kernels import AttentionMetadata
from .kv_cache import InjectedCache, KVPool


def prefill_metadata(
    cache: InjectedCache,
    keep: torch.Tensor,  # bool [B, L]: real tokens among the new columns
    positions: torch.Tensor,  # int64 [B, L]
    max_positions: int,
) -> AttentionMetadata:
    """Metadata of the real tokens of ``keep`` (row-major), appended to each row's cached tokens.

    Advances the pool's row lengths and ``cache.longest``; raises ``CapacityExceeded`` when a row would
    outgrow the pool and ``InvalidRequest`` for a position beyond the model's rotary table.
    """
    pool = cache.pool
    batch = keep.shape[0]
    device = pool.lengths.device
    lengths = pool.lengths[:batch]
    counts = keep.sum(dim=1, dtype=torch.int32)  # [B]
    top = positions.masked_fill(~keep, 0).max().to(torch.int32).view(1)
    host = torch.cat([counts, lengths, top]).tolist()  # the one device -> host read of a prefill
    new, cached, top_position = host[:batch], host[batch : 2 * batch], host[-1]
    if top_position >= max_positions:
        raise InvalidRequest(f"position {top_position} is beyond the model's {max_positions} positions")
    totals = [c + n for c, n in zip(cached, new)]
    if max(totals) > pool.capacity:
        raise CapacityExceeded(
            f"a sequence would hold {max(totals)} tokens; the injected KV cache holds {pool.capacity} per "
            "sequence (raise init_inference's max_out_tokens)"
        )
    rows = [b for b in range(batch) if new[b] > 0]  # rows with no real token this step are left out
    row_base = torch.arange(batch, device=device, dtype=torch.int64) * pool.row_slots + lengths
    slots = row_base[:, None] + keep.cumsum(dim=1) - 1  # [B, L]: slot of each real token
    cu = [0]
    for b in rows:
        cu.append(cu[-1] + new[b])
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        positions=positions[keep],
        slot_mapping=slots[keep],
        cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor([totals[b] for b in rows], dtype=torch.int32, device=device),
        block_table=pool.block_table.index_select(0, row_index),
        last_token_indices=torch.tensor(cu[1:], dtype=torch.int64, device=device) - 1,
        max_q_len=max((new[b] for b in rows), default=0),
        max_context_len=max((totals[b] for b in rows), default=0),
    )
    lengths += counts
    cache.longest = max(totals)
    return meta


def decode_metadata(
    pool: KVPool,
    mask: torch.Tensor,  # int32 [B]: 1 for a real token, 0 for padding
    positions: torch.Tensor,  # int64 [B]
) -> AttentionMetadata:
    """Metadata of one token for each of the pool's first B rows, built on the device (the row
    lengths are read before this token; the caller advances them after the forward)."""
    batch = mask.shape[0]
    lengths = pool.lengths[:batch]
    rows = torch.arange(batch, device=lengths.device, dtype=torch.int64)
    slot = torch.where(mask > 0, rows * pool.row_slots + lengths, -1)  # [B]
    return AttentionMetadata(
        positions=positions,
        slot_mapping=slot,
        cu_q_lens=torch.arange(batch + 1, device=lengths.device, dtype=torch.int32),
        context_lens=lengths + 1,
        block_table=pool.block_table[:batch],
        last_token_indices=rows,
        max_q_len=1,
        max_context_len=pool.row_slots,
    )
