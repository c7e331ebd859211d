"""Triton ragged paged attention over the blocked KV cache; twin of ``reference.paged_attention``.

Two kernels share one tile step (online softmax in fp32, exp2 domain):

- ``_prefill_kernel`` serves any ragged batch (prefill chunks and decode tokens together) in one
  launch. A program owns BLOCK_Q tokens of one sequence times all GROUP query heads of one KV head,
  so each KV tile is read once per group. Programs find their sequence by a binary search over
  ``cu_q_lens`` (no host sync), in the q-block numbering ``cu_q_lens[s] // BLOCK_Q + s``. On Hopper
  (TMA) a K/V tile lies in one cache block and arrives by one bulk copy from a tensor descriptor.
- ``_decode_kernel`` (batches with ``max_q_len == 1``) is split-K flash decoding: a program owns one
  (sequence, KV head, context split), its GROUP query heads padded to 16 rows for ``tl.dot``; on
  Hopper its K/V tiles arrive by bulk copy too. The
  last split of a (sequence, KV head) to finish merges the splits' partial softmax states (an
  arrival counter per pair); where a group's partials are too many for one program,
  ``_decode_reduce_kernel`` merges them in a second launch.
- A mixed batch whose leading decode rows would fill the GPU on their own (``fills_gpu_unsplit``)
  runs as two launches (``paged_mixed_attention``): those rows through the decode kernel, unsplit,
  and the other sequences through the prefill kernel from ``first_seq``. In the prefill kernel alone a
  decode row takes a whole BLOCK_Q-token tile for its one token.
- Where FlashAttention-4 is installed and usable (``fa4_attention``: Hopper, a prompt batch of at
  least ``MIN_PROMPT_TOKENS`` rows), it takes the prefill kernel's part of the batch.

Both take the options of ``reference.paged_attention``: a sliding window (SLIDING: tiles wholly
before a query block's window are skipped, the rest masked) and a logit soft-cap (SOFTCAP). Either
compiles as its own variant, so models without them run the same code as before.

Cache layout [num_blocks, block_size, Hk, D] with D contiguous; block_size a power of two. The
launches depend only on shapes and the Python ints ``meta.max_q_len`` / ``meta.max_context_len``, so
they can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import fa4_attention
from .counters import zeroed_counters
from .metadata import AttentionMetadata
from .pdl import pdl_launch, pdl_prologue
from .triton_pointwise import _tanh

_LOG2E = 1.4426950408889634


@triton.jit
def _load_kv(ptrs, pos_ok, d, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """A [N, D] tile of keys or values; masks only what can be out of range."""
    if MASKED:
        tile = tl.load(ptrs, mask=pos_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == D_PAD:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _product_query(q, FP16_PRODUCTS: tl.constexpr):
    """(q as the tile products take it, the factor [M] each row's logits are multiplied back by).

    FP16_PRODUCTS (a bf16 q over an fp8 cache): the products run in fp16, because fp8 widens to
    fp16 in one conversion instruction per pair and to bf16 in four, which left the decode kernel
    bound by conversions at 33-41% of HBM bandwidth (docs/BENCHMARKS.md). fp16 holds every fp8 value and every bf16 one
    below 2^16 exactly (to 2^-14), and p in [0, 1] more finely than bf16. A row with an element at
    or above 2^15 is first divided by a power of two (exact); its logits get it back."""
    if FP16_PRODUCTS:
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf), 1)
        exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax))
        shift = tl.maximum(exponent - 14, 0)
        unscale = ((shift + 127) << 23).to(tl.float32, bitcast=True)  # 2^shift, exactly
        return (qf / unscale[:, None]).to(tl.float16), unscale
    else:
        return q, tl.full([q.shape[0]], 1.0, tl.float32)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head, tile_start, q_pos, ctx,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2, window, cap_in, cap_out,
    MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, TMA: tl.constexpr = False, q_unscale=None,
    FP16_PRODUCTS: tl.constexpr = False,
):  # fmt: skip
    """One online-softmax step of q [M, D] against BLOCK_N cached keys from ``tile_start``. Keys and
    values are read in q's dtype (an fp8 cache is widened; a cache in q's dtype is unchanged).
    FP16_PRODUCTS: q comes from ``_product_query``; each row's logits are multiplied by ``q_unscale``.

    SLIDING: keys at or before ``q_pos - window`` are masked too (MASKED tiles only). SOFTCAP: the
    scaled logits s become cap * tanh(s / cap), with ``cap_in`` = scale / cap, ``cap_out`` = cap / scale.
    TMA: ``k_cache_ptr`` / ``v_cache_ptr`` are tensor descriptors of the caches viewed as
    [blocks * BLOCK_SIZE, Hk * D], and the tile lies in one cache block (BLOCK_N divides BLOCK_SIZE):
    one block-table read and one bulk copy per tile instead of a gather per key.
    """
    pos = tile_start + tl.arange(0, BLOCK_N)  # [N] key positions
    d = tl.arange(0, D_PAD)
    if MASKED:
        pos_ok = pos < ctx
    else:
        pos_ok = pos >= 0
    if TMA:
        row = tl.load(bt_row_ptr + tile_start // BLOCK_SIZE) * BLOCK_SIZE + tile_start % BLOCK_SIZE
        k = k_cache_ptr.load([row, kv_head * HEAD_DIM]).to(q.dtype)  # [N, D]
    else:
        if MASKED:
            blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
        slot = (pos % BLOCK_SIZE)[:, None]
        k = _load_kv(
            k_cache_ptr + blk[:, None] * stride_kb + slot * stride_ks + kv_head * stride_kh + d[None, :],
            pos_ok,
            d,
            MASKED,
            HEAD_DIM,
            D_PAD,
        ).to(q.dtype)  # [N, D]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [M, N], unscaled
    if FP16_PRODUCTS:
        qk = qk * q_unscale[:, None]
    if SOFTCAP:  # kept in unscaled units, so the lines below are shared
        qk = cap_out * _tanh(qk * cap_in)
    if MASKED:
        keep = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < ctx)
        if SLIDING:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)  # running max, in the scaled log2 domain
    if SLIDING:
        # why: a row may see no key of its first tiles (they precede its window); exp2(-inf - -inf)
        # would be NaN, so such a row subtracts 0 and keeps p = alpha = 0 until it meets a key
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(qk * scale_log2 - m_sub[:, None])  # why: the scale folds into one FMA
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:
        v = v_cache_ptr.load([row, kv_head * HEAD_DIM]).to(q.dtype)  # [N, D]
        if MASKED:
            # why: slots past the context were never written and may hold NaN; p = 0 there, but 0 * NaN is NaN
            v = tl.where(pos_ok[:, None], v, 0.0)
    else:
        v = _load_kv(
            v_cache_ptr + blk[:, None] * stride_vb + slot * stride_vs + kv_head * stride_vh + d[None, :],
            pos_ok,
            d,
            MASKED,
            HEAD_DIM,
            D_PAD,
        ).to(q.dtype)  # [N, D]
    acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


# why do_not_specialize: Triton compiles a variant per integer argument that is 1, a multiple of 16,
# or neither; these change with every batch, and a compile in the middle of serving costs ~1 s
@triton.jit(do_not_specialize=["first_seq", "num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, cu_q_lens_ptr, context_lens_ptr,
    scale_log2, first_seq, num_seqs, window, cap_in, cap_out,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, TMA: tl.constexpr, FP16_PRODUCTS: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    # why reversed: later q-blocks of a sequence see longer contexts; start the heavy ones first
    qblock = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    # the sequences from first_seq on (the ones before went to the decode kernel); q and out are
    # views from first_seq's first token, q_base
    cu_q_lens_ptr += first_seq
    context_lens_ptr += first_seq
    block_table_ptr += first_seq.to(tl.int64) * stride_bt
    q_base = tl.load(cu_q_lens_ptr)
    # the sequence owning this q-block: largest s with (cu_q_lens[s] - q_base) // BLOCK_Q + s <= qblock
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = (tl.load(cu_q_lens_ptr + mid) - q_base) // BLOCK_Q + mid
        lo = tl.where(first <= qblock, mid, lo)
        hi = tl.where(first <= qblock, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_q_lens_ptr + seq) - q_base
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_base - q_start
    local = qblock - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + rows // G_PAD  # [M] token index within the sequence's new tokens
    head = kv_head * GROUP + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < GROUP)
    d = tl.arange(0, D_PAD)
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    io_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)  # [M, D]
    q, q_unscale = _product_query(q, FP16_PRODUCTS)
    q_pos = ctx - q_len + tok  # [M] position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    first_pos = ctx - q_len + local * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, ctx)  # keys beyond the block's last query are masked
    n_full = (first_pos + 1) // BLOCK_N  # tiles up to here end at or before every row's own position
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    t_full = 0  # first tile every row of the block sees in full (the window's start, when sliding)
    if SLIDING:
        # tiles before t_lo end before the first row's window: skipped; [t_lo, t_full) is masked
        t_lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
        t_full = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N), n_full)
        for t in range(t_lo, t_full):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, kv_head, t * BLOCK_N, q_pos, ctx,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2, window, cap_in,
                cap_out, True, BLOCK_SIZE, BLOCK_N, HEAD_DIM, D_PAD, DOT_PREC, SLIDING, SOFTCAP, TMA,
                q_unscale, FP16_PRODUCTS,
            )  # fmt: skip
    for t in range(t_full, n_full):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, kv_head, t * BLOCK_N, q_pos, ctx,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2, window, cap_in,
            cap_out, False, BLOCK_SIZE, BLOCK_N, HEAD_DIM, D_PAD, DOT_PREC, SLIDING, SOFTCAP, TMA,
            q_unscale, FP16_PRODUCTS,
        )  # fmt: skip
    for t in range(n_full, n_tiles):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, kv_head, t * BLOCK_N, q_pos, ctx,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2, window, cap_in,
            cap_out, True, BLOCK_SIZE, BLOCK_N, HEAD_DIM, D_PAD, DOT_PREC, SLIDING, SOFTCAP, TMA,
            q_unscale, FP16_PRODUCTS,
        )  # fmt: skip
    out = acc / l_i[:, None]
    o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, arrivals_ptr,
    block_table_ptr, cu_q_lens_ptr, context_lens_ptr, scale_log2, window, cap_in, cap_out,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, M_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    DOT_PREC: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr, G_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
    FP16_PRODUCTS: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """MERGE_IN_KERNEL: the last split of a (sequence, KV head) to finish merges the partial states
    of all its splits (counted in ``arrivals_ptr``, which it resets to 0), instead of a reduce launch."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # why before the wait: the step's metadata is no kernel's output (see pdl.py), so these reads
    # overlap the previous kernel's tail
    q_idx = tl.load(cu_q_lens_ptr + seq)
    q_end = tl.load(cu_q_lens_ptr + seq + 1)
    ctx = tl.load(context_lens_ptr + seq)
    pdl_prologue(PDL)
    if q_end == q_idx:  # a sequence with no new token this step
        return
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    t_lo = _first_tile(ctx, window, BLOCK_N, SLIDING)
    per_split = tl.cdiv(n_tiles - t_lo, NUM_SPLITS)
    t_begin = t_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)
    if t_begin >= t_end:
        return

    rows = tl.arange(0, M_PAD)
    head = kv_head * GROUP + rows
    d = tl.arange(0, D_PAD)
    io_mask = (rows < GROUP)[:, None] & (d[None, :] < HEAD_DIM)
    q_off = q_idx.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)  # [M, D]
    q, q_unscale = _product_query(q, FP16_PRODUCTS)
    q_pos = tl.zeros([M_PAD], dtype=tl.int32) + (ctx - 1)

    m_i = tl.full([M_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M_PAD], dtype=tl.float32)
    acc = tl.zeros([M_PAD, D_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t_begin, t_end):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, kv_head, t * BLOCK_N, q_pos, ctx,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2, window, cap_in,
            cap_out, True, BLOCK_SIZE, BLOCK_N, HEAD_DIM, D_PAD, DOT_PREC, SLIDING, SOFTCAP,
            TMA, q_unscale, FP16_PRODUCTS,
        )  # fmt: skip
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_off = q_idx.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partial state of (seq, head, split): acc at [..., D_PAD], (m, l) at [..., 2]
        part = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + split  # [M]
        row_ok = rows < GROUP
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        if MERGE_IN_KERNEL:
            n_active = tl.cdiv(n_tiles - t_lo, per_split)  # splits that hold a tile
            tl.debug_barrier()  # every thread's partial stores come before this program's arrival
            arrivals = arrivals_ptr + seq * (NUM_HEADS // GROUP) + kv_head
            if tl.atomic_add(arrivals, 1, sem="acq_rel") == n_active - 1:
                tl.store(arrivals, 0)  # why: the next launch (or CUDA graph replay) counts from 0 again
                _merge_group_splits(
                    out_ptr, part_acc_ptr, part_ml_ptr, seq, kv_head, q_idx, n_active, stride_ot, stride_oh,
                    NUM_HEADS, GROUP, G_PAD, NUM_SPLITS, SPLITS_PAD, HEAD_DIM, D_PAD,
                )  # fmt: skip


@triton.jit
def _merge_group_splits(
    out_ptr, part_acc_ptr, part_ml_ptr, seq, kv_head, q_idx, n_active, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """The output of the GROUP query heads of one KV head: their splits' partial softmax states merged.
    Partials are read past L1 (``.cg``): other SMs wrote them."""
    g = tl.arange(0, G_PAD)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    head = kv_head * GROUP + g  # [G]
    part = (seq * NUM_HEADS + head).to(tl.int64)[:, None] * NUM_SPLITS + sp[None, :]  # [G, P]
    ok = (g < GROUP)[:, None] & (sp < n_active)[None, :]
    m = tl.load(part_ml_ptr + part * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
    lse = tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
    m_max = tl.where(g < GROUP, tl.max(m, 1), 0.0)  # padding rows: 0, not -inf (their exp2 stays finite)
    w = tl.where(ok, tl.math.exp2(m - m_max[:, None]), 0.0)  # [G, P]
    acc = tl.load(
        part_acc_ptr + part[:, :, None] * D_PAD + d[None, None, :], mask=ok[:, :, None], other=0.0,
        cache_modifier=".cg",
    )  # [G, P, D]
    out = tl.sum(acc * w[:, :, None], 1) / tl.sum(lse * w, 1)[:, None]  # [G, D]
    o_off = q_idx.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _first_tile(ctx, window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """The first key tile a decode query at position ctx - 1 sees (0 without a window)."""
    first = 0
    if SLIDING:
        first = tl.maximum(ctx - window, 0) // BLOCK_N
    return first


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, cu_q_lens_ptr, context_lens_ptr, stride_ot, stride_oh, window,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SLIDING: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_idx = tl.load(cu_q_lens_ptr + seq)
    if tl.load(cu_q_lens_ptr + seq + 1) == q_idx:
        return
    ctx = tl.load(context_lens_ptr + seq)
    n_tiles = tl.cdiv(ctx, BLOCK_N) - _first_tile(ctx, window, BLOCK_N, SLIDING)
    n_splits = tl.cdiv(n_tiles, tl.cdiv(n_tiles, NUM_SPLITS))  # splits that hold any tile
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < n_splits
    part = (seq * NUM_HEADS + head).to(tl.int64) * NUM_SPLITS + sp  # [P]
    m = tl.load(part_ml_ptr + part * 2, mask=sp_ok, other=float("-inf"))
    lse = tl.load(part_ml_ptr + part * 2 + 1, mask=sp_ok, other=0.0)
    w = tl.where(sp_ok, tl.math.exp2(m - tl.max(m, 0)), 0.0)  # [P]
    d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(lse * w, 0)  # [D]
    o_off = q_idx.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp16_products(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the tile products run in fp16 (``_product_query``): a bf16 q over an fp8 cache."""
    return q.dtype == torch.bfloat16 and cache.element_size() == 1


def _dot_precision(dtype: torch.dtype) -> str:
    # why: fp32 inputs would otherwise run through tf32 and miss the fp32 reference
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, block_n: int, sms: int) -> int:
    """Context splits per (sequence, KV head): about two programs per SM, >= 4 tiles a split.

    Measured on an H200 at batch 64 x 8 KV heads (512 programs), one split beat 2, 4 and 8.
    """
    if num_seqs == 0:
        return 1
    want = triton.cdiv(2 * sms, num_seqs * num_kv_heads)
    most = max(1, triton.cdiv(max_context_len, 4 * block_n))
    return int(max(1, min(want, most, 64)))


# fp32 elements of one group's partial accumulators [group, splits, D] the finishing program loads at once
MERGE_IN_KERNEL_MAX_ELEMENTS = 4 * 32 * 128
def split_arrivals(device: torch.device, pairs: int) -> torch.Tensor | None:
    """The device's zeroed split-arrival counters, one per (sequence, KV head) pair, or None where
    they cannot serve (see ``counters.zeroed_counters``); each launch returns them to 0."""
    return zeroed_counters(device, "decode split arrivals", pairs)


def _softcap_args(scale: float, logit_softcap: float) -> tuple[float, float]:
    """(cap_in, cap_out) for ``_attend_tile``; unused (1.0) without a soft-cap."""
    return (scale / logit_softcap, logit_softcap / scale) if logit_softcap else (1.0, 1.0)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    merge_in_kernel: bool | None = None,
    out: torch.Tensor | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """Split-K decode attention for batches of at most one new token per sequence.

    ``tma`` (default: where ``tma_supported``, on Hopper): K/V tiles arrive by bulk copies. Measured
    on an H200 at 256 x 640 and 64 x 2,048 (docs/BENCHMARKS.md, "Decode attention over an fp8 KV
    cache"): an fp8 cache's kernel went from 46% and 37% of HBM bandwidth to 58%; a bf16 cache's
    from 93.4% to 94.7% and 93.0% to 93.7%.

    ``merge_in_kernel`` (default: when one group's partial states fit ``MERGE_IN_KERNEL_MAX_ELEMENTS``):
    the splits are merged by the last of them to finish, not by a second launch. ``out``: where to
    write (shaped like q; a new tensor when None).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = meta.context_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    on_gpu = q.is_cuda
    if block_n is None:
        block_n = 64 if on_gpu else 16
    if tma is None:
        tma = on_gpu and _has_tma(q.device) and tma_supported(k_cache, v_cache, block_n)
    if num_splits is None:
        seen = min(meta.max_context_len, sliding_window) if sliding_window else meta.max_context_len
        num_splits = decode_num_splits(num_seqs, num_kv_heads, seen, block_n, _num_sms(q.device))
    cap_in, cap_out = _softcap_args(scale, logit_softcap)
    d_pad = triton.next_power_of_2(head_dim)
    g_pad = triton.next_power_of_2(group)
    splits_pad = triton.next_power_of_2(num_splits)
    arrivals = None  # set when the splits merge in the kernel
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, d_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
        if merge_in_kernel is None:
            merge_in_kernel = g_pad * splits_pad * d_pad <= MERGE_IN_KERNEL_MAX_ELEMENTS
        if merge_in_kernel:
            arrivals = split_arrivals(q.device, num_seqs * num_kv_heads)
    else:
        part_acc = part_ml = out  # unused
    k_tiles, v_tiles = k_cache, v_cache
    if tma:
        k_tiles, v_tiles = _cache_descriptor(k_cache, block_n), _cache_descriptor(v_cache, block_n)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_tiles, v_tiles, out, part_acc, part_ml, out if arrivals is None else arrivals,
        meta.block_table, meta.cu_q_lens, meta.context_lens, scale * _LOG2E, sliding_window, cap_in, cap_out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=group, M_PAD=max(16, triton.next_power_of_2(group)),
        NUM_SPLITS=num_splits, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=d_pad, DOT_PREC=_dot_precision(q.dtype),
        SLIDING=bool(sliding_window), SOFTCAP=bool(logit_softcap),
        MERGE_IN_KERNEL=arrivals is not None, G_PAD=g_pad, SPLITS_PAD=splits_pad,
        FP16_PRODUCTS=fp16_products(q, k_cache), TMA=tma, num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(q.device),
    )  # fmt: skip
    if num_splits > 1 and arrivals is None:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_ml, meta.cu_q_lens, meta.context_lens, out.stride(0), out.stride(1),
            sliding_window,
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_PAD=splits_pad,
            BLOCK_N=block_n, HEAD_DIM=head_dim, D_PAD=d_pad, SLIDING=bool(sliding_window),
            num_warps=4 if d_pad >= 128 else 1, **pdl_launch(q.device),
        )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tma: bool | None = None,
    first_seq: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged causal attention for any mix of prefill chunks and decode tokens, in one launch.

    ``tma`` (default: where ``tma_supported``) reads K/V tiles by tensor-memory-accelerator bulk copies.
    ``first_seq``: attend only the sequences from this one on; q then holds their tokens only (its
    first row is the token at ``meta.cu_q_lens[first_seq]``; see ``paged_mixed_attention``).
    ``out``: where to write (shaped like q; a new tensor when None).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = meta.context_lens.shape[0] - first_seq
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    on_gpu = q.is_cuda
    d_pad = triton.next_power_of_2(head_dim)
    g_pad = triton.next_power_of_2(group)
    if tma is None:
        # measured at D = 128 only; a wider head's [block_n, D] copy is left to the pointer path
        tma = on_gpu and _has_tma(q.device) and d_pad <= 128 and block_size >= 32
        tma = tma and tma_supported(k_cache, v_cache, block_n or min(block_size, 64))
    # tiles measured on an H200 (Llama-3-8B heads, D=128, bf16, 8 x 2048 causal): by bulk copy,
    # 128 x 64 with 4 warps and 2 stages led (0.67 ms, 52% of peak); by pointers, 128 x 32 with 4 warps
    if block_m is None:
        block_m = (128 if d_pad <= 128 else 64) if on_gpu else 16
    if block_n is None:
        block_n = (min(block_size, 64) if tma else 32) if on_gpu else 16
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 2 if tma or d_pad > 128 else 3
    k_tiles, v_tiles = k_cache, v_cache
    if tma:
        k_tiles, v_tiles = _cache_descriptor(k_cache, block_n), _cache_descriptor(v_cache, block_n)
    block_q = max(1, block_m // g_pad)
    # q-blocks are numbered (cu_q_lens[s] - cu_q_lens[first_seq]) // block_q + s - first_seq, so this
    # many cover every sequence
    num_qblocks = num_tokens // block_q + num_seqs
    cap_in, cap_out = _softcap_args(scale, logit_softcap)
    _prefill_kernel[(num_qblocks, num_kv_heads)](
        q, k_tiles, v_tiles, out, meta.block_table, meta.cu_q_lens, meta.context_lens,
        scale * _LOG2E, first_seq, num_seqs, sliding_window, cap_in, cap_out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_table.stride(0),
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=d_pad, DOT_PREC=_dot_precision(q.dtype),
        SLIDING=bool(sliding_window), SOFTCAP=bool(logit_softcap), TMA=tma,
        FP16_PRODUCTS=fp16_products(q, k_cache), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


@functools.lru_cache(maxsize=8)
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_supported(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether K/V tiles of ``block_n`` keys can be bulk-copied: contiguous caches whose blocks
    hold whole tiles, a power-of-two head size, rows aligned to 16 bytes."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    row_bytes = num_kv_heads * head_dim * k_cache.element_size()
    return (
        k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and block_size % block_n == 0
        and head_dim & (head_dim - 1) == 0
        and row_bytes % 16 == 0
    )


def _cache_descriptor(cache: torch.Tensor, block_n: int) -> TensorDescriptor:
    """A [blocks * block_size, Hk * D] view of the cache, copied in [block_n, D] tiles."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    width = num_kv_heads * head_dim
    return TensorDescriptor(cache, [num_blocks * block_size, width], [width, 1], [block_n, head_dim])


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
    """Causal attention of a ragged batch over the cache; see ``reference.paged_attention``.

    Decode-only batches (``meta.max_q_len == 1``) take the split-K decode kernel. A mixed batch whose
    leading decode rows (``meta.num_decode_seqs``) fill the GPU (``fills_gpu_unsplit``) sends them to
    the decode kernel and the rest to the ragged prefill kernel; any other batch takes the prefill
    kernel alone, which also serves the decode tokens mixed into it. Where ``fa4_attention.usable``
    (FlashAttention-4 installed, on Hopper), FlashAttention-4 takes the ragged kernel's part.
    """
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.shape[1] & (k_cache.shape[1] - 1) == 0, "block_size must be a power of two"
    assert not math.isnan(scale)
    options = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
    if meta.max_q_len <= 1:
        return paged_decode_attention(q, k_cache, v_cache, meta, scale, **options)
    if fills_gpu_unsplit(meta.num_decode_seqs, k_cache.shape[2], q.device):
        return paged_mixed_attention(q, k_cache, v_cache, meta, scale, **options)
    if fa4_attention.usable(q, k_cache, v_cache, q.shape[0], **options):
        out = fa4_attention.paged_prefill_attention(q, k_cache, v_cache, meta, scale)
        if out is not None:
            return out
    return paged_prefill_attention(q, k_cache, v_cache, meta, scale, **options)


def fills_gpu_unsplit(num_decode_seqs: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether a mixed batch's decode rows are enough (sequence, KV head) programs, about two per SM,
    for the decode kernel without context splits, which is how ``paged_mixed_attention`` runs it.

    why: measured on an H200 (docs/BENCHMARKS.md, mixed steps), the split was 1.05x faster with 64
    decode rows beside a full prefill chunk, 1.18x with 256, 1.39-1.45x with 256-512 beside a
    512-token chunk; with 1-16 rows it gained at most 2% or lost 5%. (It lost 13% with 128 rows
    beside a 64-token chunk: the tail of a prompt queue, rare.) Unsplit, so one compiled variant
    serves every mixed step (the split count is a compile-time constant, and a compile mid-serving
    costs about a second).
    """
    return num_decode_seqs > 0 and num_decode_seqs * num_kv_heads >= 2 * _num_sms(device)


def paged_mixed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """A mixed batch in two launches: its ``meta.num_decode_seqs`` leading single-token sequences
    through the decode kernel (one program per sequence and KV head, no context splits), the other
    sequences through the ragged prefill kernel (or FlashAttention-4, see ``fa4_attention``)."""
    options = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
    n = meta.num_decode_seqs
    out = torch.empty_like(q)
    # why slices only at the front (and first_seq for the rest): Triton compiles a kernel variant
    # per pointer alignment, and a slice from row n would shift it as n changes
    decode = meta.leading_decodes
    paged_decode_attention(q[:n], k_cache, v_cache, decode, scale, num_splits=1, out=out[:n], **options)
    if fa4_attention.usable(q, k_cache, v_cache, q.shape[0] - n, **options):
        rest = fa4_attention.paged_prefill_attention(q[n:], k_cache, v_cache, meta.trailing_prompts, scale, out=out[n:])
        if rest is not None:
            return out
    paged_prefill_attention(q[n:], k_cache, v_cache, meta, scale, first_seq=n, out=out[n:], **options)
    return out
