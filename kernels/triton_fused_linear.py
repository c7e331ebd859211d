"""Few-row products with the step after them in their epilogue: a gated MLP's gate and up with its
activation, and an attention layer's q/k/v with rotary and the KV-cache append (16-bit or fp8 weights).

At a few rows a product only reads its weight, and the activation launch after it costs a few
microseconds of launch and ramp for a few kilobytes of work. ``linear_silu_and_mul`` /
``linear_gelu_tanh_and_mul`` (twins of the reference compositions, rounded where those round): a
program owns BLOCK_N columns of the activation and multiplies x by the matching gate rows and up rows
of the packed weight (two accumulators), so act(gate) * up is formed in registers and only the
activation is written. Up to ``DENSE_MAX_ROWS`` rows (``few_row_product``); more rows go to cuBLAS
and the activation kernel.

Measured on one H200, Llama-3-8B's gate_up (bench/kernels_bench.py --no-attention --fused): 55.8 us
against 57.5 for cuBLAS and the activation at one row (the weight-read floor is 55.4), 56.1 against
62.0 at 16 rows. Tried and dropped: the residual add and RMSNorm in the epilogue of o_proj and down,
the last program to finish norming the rows; its serial tail cost what the saved launch gave back at
one row (13.30 against 13.28 us for o_proj) and 10 us at 16 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_prefetch_rows, pdl_release, pdl_wait, prefetch_lines
from .reference import split_qkv
from .reference_quant import Fp8Rows
from .triton_attention import _dot_precision, _num_sms
from .triton_fp8 import FEW_ROWS, FP8_MMA_K, PREFETCH_K_TILES, fp8_linear, quantize_fp8_per_token
from .triton_one_row import one_row_tiles, row_sums
from .triton_pointwise import act_and_mul_values, gelu_tanh_and_mul, rotary_kv_append, silu_and_mul
from .triton_quant import few_row_product, fit_k_step, gemm_tile

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the gated product: BLOCK_N columns of gate and as many
# of up per program; the fastest of 18 shapes at one row of Llama-3-8B's gate_up on an H200 (56.8 us
# against 57.6 for the next) and the fastest at 16 rows (bench/kernels_bench.py --no-attention --fused
# --sweep fused --gemm-rows 1 16)
GATED_TILES = (16, 64, 128, 4, 3)


# why do_not_specialize: M changes with every batch; a Triton variant per value class of M would
# compile in the middle of serving
@triton.jit(do_not_specialize=["M"])
def _linear_act_and_mul_kernel(
    x_ptr, w_ptr, out_ptr, M, I, K, stride_xm, stride_wn, stride_om,
    GELU_TANH: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    rm, rn, m_ok, n_ok = gemm_tile(M, I, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
    gate_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # [1, BN]
    up_cols = gate_cols + I.to(tl.int64) * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # why the first K tile apart: see _weight_only_gemm_kernel
    first_mask = (rk < K)[:, None] & n_ok[None, :]
    gate_first = tl.load(gate_cols + rk[:, None], mask=first_mask, other=0.0)  # [BK, BN]
    up_first = tl.load(up_cols + rk[:, None], mask=first_mask, other=0.0)
    pdl_wait(PDL)
    x_first = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)  # [BM, BK]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        w_mask = k_ok[:, None] & n_ok[None, :]
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        gate = tl.load(gate_cols + k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        up = tl.load(up_cols + k[:, None], mask=w_mask, other=0.0)
        acc_gate = tl.dot(x, gate, acc_gate, input_precision=DOT_PREC)
        acc_up = tl.dot(x, up, acc_up, input_precision=DOT_PREC)
    acc_gate = tl.dot(x_first, gate_first, acc_gate, input_precision=DOT_PREC)
    acc_up = tl.dot(x_first, up_first, acc_up, input_precision=DOT_PREC)
    pdl_release(PDL)  # why after the loop: see pdl.py
    dtype = x_ptr.dtype.element_ty
    # why the casts: the unfused product stores gate and up in the input dtype before the activation
    y = act_and_mul_values(acc_gate.to(dtype), acc_up.to(dtype), GELU_TANH)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _one_row_act_and_mul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, I, K, stride_wn, stride_ws, GELU_TANH: tl.constexpr,
    FP8: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    REDUCE_EACH_STEP: tl.constexpr, PREFETCH_LINES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One row (``triton_one_row``'s loop): a program owns BLOCK_N gate rows and the matching up rows,
    read as one tile of interleaved rows; the activation is formed from the two sums (``FP8``: each
    first times its row's weight scale and x's scale, as the fp8 GEMM stores them)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    gate_rows = tl.minimum(rn, I - 1).to(tl.int64)  # the last tile's spare rows read a real row
    row_ids = tl.join(gate_rows, gate_rows + I).reshape(2 * BLOCK_N)
    rows = w_ptr + row_ids * stride_wn
    pdl_prefetch_rows(rows, PREFETCH_LINES, PDL)
    pdl_wait(PDL)
    sums = row_sums(x_ptr, rows, rows, K, 1, False, EVEN_K, BLOCK_K, REDUCE_EACH_STEP, 1.0, False)
    pdl_release(PDL)  # why after the loop: see pdl.py
    if FP8:
        sums = sums * tl.load(w_scale_ptr + row_ids * stride_ws) * tl.load(x_scale_ptr)
    gate, up = tl.split(sums.reshape(BLOCK_N, 2))
    dtype = out_ptr.dtype.element_ty
    # why the casts: the unfused product stores gate and up in the input dtype before the activation
    y = act_and_mul_values(gate.to(dtype), up.to(dtype), GELU_TANH)
    tl.store(out_ptr + rn, y.to(dtype), mask=n_ok)


def one_row_pair_tiles(k: int, element_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) at one row: BLOCK_M 1 for ``triton_one_row``'s loop
    over its tile of weight rows, half of them from each of the two row ranges a fused kernel pairs
    (gate and up; the two halves of a head), BLOCK_N from each."""
    rows, block_k, warps = one_row_tiles(k, element_size)
    return 1, rows // 2, block_k, warps, 1


def linear_act_and_mul(
    x: torch.Tensor, weight: torch.Tensor, gelu_tanh: bool, tiles: tuple[int, int, int, int, int] | None = None
) -> torch.Tensor:
    """``linear_silu_and_mul`` or (``gelu_tanh``) ``linear_gelu_tanh_and_mul``; ``tiles`` (BLOCK_M,
    BLOCK_N, BLOCK_K, warps, stages) instead of ``GATED_TILES`` (for the tile sweep)."""
    if not few_row_product(x, weight):
        act_and_mul = gelu_tanh_and_mul if gelu_tanh else silu_and_mul
        return act_and_mul(torch.nn.functional.linear(x, weight))
    m, k = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = tiles or (one_row_pair_tiles(k, x.element_size()) if m == 1 else GATED_TILES)
    if bm == 1:
        assert m == 1, "the one-row kernel takes one row"
        return _launch_one_row_act_and_mul(x, None, weight, None, out, gelu_tanh, (bn, bk, warps))
    _linear_act_and_mul_kernel[(triton.cdiv(inter, bn), triton.cdiv(m, bm))](
        x, weight, out, m, inter, k, x.stride(0), weight.stride(0), out.stride(0),
        GELU_TANH=gelu_tanh, DOT_PREC=_dot_precision(x.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def _launch_one_row_act_and_mul(
    x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, w_scale: torch.Tensor | None,
    out: torch.Tensor, gelu_tanh: bool, tiles: tuple[int, int, int],
) -> torch.Tensor:  # fmt: skip
    """One launch of ``_one_row_act_and_mul_kernel`` (fp8 when given scales) writing ``out``."""
    bn, bk, warps = tiles
    k = x.shape[1]
    programs = triton.cdiv(out.shape[1], bn)
    fp8 = w_scale is not None
    _one_row_act_and_mul_kernel[(programs,)](
        x, x_scale if fp8 else x, weight, w_scale if fp8 else x, out, out.shape[1], k, weight.stride(0),
        w_scale.stride(0) if fp8 else 0, GELU_TANH=gelu_tanh, FP8=fp8, EVEN_K=k % bk == 0, BLOCK_N=bn,
        BLOCK_K=bk, REDUCE_EACH_STEP=programs >= 4 * _num_sms(x.device),
        PREFETCH_LINES=prefetch_lines(k, PREFETCH_K_TILES * bk) if fp8 else 0, num_warps=warps, num_stages=1,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out


def fp8_linear_act_and_mul(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, gelu_tanh: bool, gemm: str = "auto",
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``fp8_linear_silu_and_mul`` or (``gelu_tanh``) ``fp8_linear_gelu_tanh_and_mul``: one launch at
    one row where ``fp8_linear`` would run its Triton kernel on a weight with one scale per output
    channel, else ``fp8_linear`` and the activation. ``tiles``: instead of ``one_row_pair_tiles``'."""
    q8, x_scale, dtype = x if isinstance(x, Fp8Rows) else (*quantize_fp8_per_token(x), x.dtype)
    fused = (
        gemm in ("auto", "triton")
        and q8.shape[0] == 1
        and scale.shape[1] == 1
        and q8.stride(-1) == 1
        and weight.stride(-1) == 1
    )
    if not fused:
        act_and_mul = gelu_tanh_and_mul if gelu_tanh else silu_and_mul
        return act_and_mul(fp8_linear(Fp8Rows(q8, x_scale, dtype), weight, scale, None, gemm))
    _, bn, bk, warps, _ = tiles or one_row_pair_tiles(q8.shape[1], q8.element_size())
    out = torch.empty((1, weight.shape[0] // 2), dtype=dtype, device=q8.device)
    return _launch_one_row_act_and_mul(q8, x_scale, weight, scale, out, gelu_tanh, (bn, bk, warps))


def fp8_linear_silu_and_mul(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, gemm: str = "auto"
) -> torch.Tensor:
    """See ``reference.fp8_linear_silu_and_mul``."""
    return fp8_linear_act_and_mul(x, weight, scale, gelu_tanh=False, gemm=gemm)


def fp8_linear_gelu_tanh_and_mul(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor, gemm: str = "auto"
) -> torch.Tensor:
    """See ``reference.fp8_linear_gelu_tanh_and_mul``."""
    return fp8_linear_act_and_mul(x, weight, scale, gelu_tanh=True, gemm=gemm)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See ``reference.linear_silu_and_mul``."""
    return linear_act_and_mul(x, weight, gelu_tanh=False)


def linear_gelu_tanh_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See ``reference.linear_gelu_tanh_and_mul``."""
    return linear_act_and_mul(x, weight, gelu_tanh=True)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of q/k/v with rotary: BLOCK_N columns of each half of a head
# per program; the fastest of 36 shapes at one row of Llama-3-8B's q/k/v on an H200, 15.6 us against
# 18.3 for cuBLAS and rotary_kv_append (weight-read floor 11.9; 16-column tiles took 22-36 us)
# (bench/kernels_bench.py --no-attention --fused --sweep fused --gemm-rows 1)
QKV_ROTARY_TILES = (16, 32, 256, 4, 4)


def _qkv_rotary_tiles(
    tiles: tuple[int, int, int, int, int] | None, default: tuple[int, int, int, int, int], x: torch.Tensor,
    half: int,
) -> tuple[int, int, int, int, int]:
    """q/k/v tiles fitted to the problem: at one row (none given) the one-row loop's, else ``default``
    with the K step by ``fit_k_step``; no wider than half a head."""
    if tiles is None and x.shape[0] == 1:
        tiles = one_row_pair_tiles(x.shape[1], x.element_size())
    elif tiles is None or tiles[0] > 1:
        tiles = fit_k_step(tiles or default, x.element_size())
    bm, bn, bk, warps, stages = tiles
    return bm, min(bn, half), bk, warps, stages


@triton.jit(do_not_specialize=["M"])
def _linear_rotary_kv_append_kernel(
    x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr,
    cos_sin_ptr, M, K, stride_xm, stride_wn, stride_ws, stride_qt, stride_qh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, FP8: tl.constexpr, DOT_PREC: tl.constexpr, PROMOTE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH_LINES: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """A program owns BLOCK_N columns of one half of one head and the same columns of its other half
    (the pairs rotary mixes), for BLOCK_M rows; heads run q, then k, then v, as the packed weight's rows.
    ``FP8``: x and the weight are fp8, x with a scale per row (``x_scale_ptr``) and the weight one per
    output channel (``w_scale_ptr``), applied as the fp8 GEMM applies them (``triton_fp8``)."""
    tiles_per_half: tl.constexpr = HALF // BLOCK_N
    head = tl.program_id(0) // tiles_per_half
    c = (tl.program_id(0) % tiles_per_half) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns within a half
    rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
    first_cols = w_ptr + (head * 2 * HALF + c)[None, :].to(tl.int64) * stride_wn  # [1, BN]
    second_cols = first_cols + HALF * stride_wn
    acc_first = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_second = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # why the first K tile apart: see triton_quant._weight_only_gemm_kernel (fp8 weights stream every
    # tile, as the fp8 GEMM does: held apart, it was slower there; they are prefetched to L2 instead)
    rows = (head * 2 * HALF + c).to(tl.int64)
    pdl_prefetch_rows(w_ptr + tl.join(rows, rows + HALF).reshape(2 * BLOCK_N) * stride_wn, PREFETCH_LINES, PDL)
    PEEL: tl.constexpr = not FP8
    if PEEL:
        tile0_first = tl.load(first_cols + rk[:, None], mask=(rk < K)[:, None], other=0.0)  # [BK, BN]
        tile0_second = tl.load(second_cols + rk[:, None], mask=(rk < K)[:, None], other=0.0)
    pdl_wait(PDL)
    if PEEL:
        x_tile0 = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)  # [BM, BK]
    for k0 in range(BLOCK_K if PEEL else 0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w_first = tl.load(first_cols + k[:, None], mask=k_ok[:, None], other=0.0)  # [BK, BN]
        w_second = tl.load(second_cols + k[:, None], mask=k_ok[:, None], other=0.0)
        if FP8:  # why max_num_imprecise_acc: see triton_fp8._fp8_gemm_kernel
            acc_first = tl.dot(x, w_first, acc_first, max_num_imprecise_acc=PROMOTE_K)
            acc_second = tl.dot(x, w_second, acc_second, max_num_imprecise_acc=PROMOTE_K)
        else:
            acc_first = tl.dot(x, w_first, acc_first, input_precision=DOT_PREC)
            acc_second = tl.dot(x, w_second, acc_second, input_precision=DOT_PREC)
    if PEEL:
        acc_first = tl.dot(x_tile0, tile0_first, acc_first, input_precision=DOT_PREC)
        acc_second = tl.dot(x_tile0, tile0_second, acc_second, input_precision=DOT_PREC)
    pdl_release(PDL)  # why after the loop: see pdl.py
    if FP8:  # the fp8 GEMM's epilogue: the weight's scale of each column, then the row's
        acc_first = acc_first * tl.load(w_scale_ptr + (head * 2 * HALF + c) * stride_ws)[None, :]
        acc_second = acc_second * tl.load(w_scale_ptr + (head * 2 * HALF + HALF + c) * stride_ws)[None, :]
        x_scale = tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)[:, None]
        acc_first = acc_first * x_scale
        acc_second = acc_second * x_scale
    if HAS_BIAS:
        acc_first += tl.load(bias_ptr + head * 2 * HALF + c).to(tl.float32)[None, :]
        acc_second += tl.load(bias_ptr + head * 2 * HALF + HALF + c).to(tl.float32)[None, :]
    _rotary_kv_store(
        acc_first, acc_second, rm, m_ok, head, c, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr,
        stride_qt, stride_qh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        stride_cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, HALF, BLOCK_SIZE,
    )  # fmt: skip


@triton.jit
def _one_row_qkv_rotary_kernel(
    x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr,
    cos_sin_ptr, K, stride_wn, stride_ws, stride_qt, stride_qh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, FP8: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, REDUCE_EACH_STEP: tl.constexpr, PREFETCH_LINES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One row (``triton_one_row``'s loop): a program owns BLOCK_N columns of both halves of one head,
    read as one tile of interleaved weight rows; then ``_linear_rotary_kv_append_kernel``'s epilogue."""
    tiles_per_half: tl.constexpr = HALF // BLOCK_N
    head = tl.program_id(0) // tiles_per_half
    c = (tl.program_id(0) % tiles_per_half) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns within a half
    first_rows = (head * 2 * HALF + c).to(tl.int64)
    rows = w_ptr + tl.join(first_rows, first_rows + HALF).reshape(2 * BLOCK_N) * stride_wn
    pdl_prefetch_rows(rows, PREFETCH_LINES, PDL)
    pdl_wait(PDL)
    sums = row_sums(x_ptr, rows, rows, K, 1, False, EVEN_K, BLOCK_K, REDUCE_EACH_STEP, 1.0, False)
    pdl_release(PDL)  # why after the loop: see pdl.py
    acc_first, acc_second = tl.split(sums.reshape(BLOCK_N, 2))
    if FP8:  # the fp8 GEMM's epilogue: the weight's scale of each column, then the row's
        x_scale = tl.load(x_scale_ptr)
        acc_first = acc_first * tl.load(w_scale_ptr + first_rows * stride_ws) * x_scale
        acc_second = acc_second * tl.load(w_scale_ptr + (first_rows + HALF) * stride_ws) * x_scale
    if HAS_BIAS:
        acc_first += tl.load(bias_ptr + first_rows).to(tl.float32)
        acc_second += tl.load(bias_ptr + first_rows + HALF).to(tl.float32)
    rm = tl.zeros([1], dtype=tl.int64)
    _rotary_kv_store(
        acc_first[None, :], acc_second[None, :], rm, rm == 0, head, c, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
        slot_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kcb, stride_kcs, stride_kch, stride_vcb,
        stride_vcs, stride_vch, stride_cos_sin, NUM_Q_HEADS, NUM_KV_HEADS, HALF, BLOCK_SIZE,
    )  # fmt: skip


@triton.jit
def _rotary_kv_store(
    acc_first, acc_second, rm, m_ok, head, c, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """The q/k/v kernels' epilogue: float32 products [BM, BN] of columns ``c`` of both halves of
    ``head`` (scaled, bias added) for rows ``rm``, rounded, rotated (q and k), and stored: q to its
    output, k and v to their cache slots."""
    dtype = q_ptr.dtype.element_ty
    # why the casts: the unfused product stores q/k/v in the input dtype, and rotary rounds to it again
    first = acc_first.to(dtype)
    second = acc_second.to(dtype)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # q and k rotate
        pos = tl.load(pos_ptr + rm, mask=m_ok, other=0).to(tl.int64)
        cos_ptrs = cos_sin_ptr + pos[:, None] * stride_cos_sin + c[None, :]
        cos = tl.load(cos_ptrs, mask=m_ok[:, None], other=0.0)
        sin = tl.load(cos_ptrs + HALF, mask=m_ok[:, None], other=0.0)
        a = first.to(tl.float32)
        b = second.to(tl.float32)
        first = (a * cos - b * sin).to(dtype)
        second = (b * cos + a * sin).to(dtype)
    if head < NUM_Q_HEADS:
        q_out = q_ptr + rm[:, None] * stride_qt + head * stride_qh + c[None, :]
        tl.store(q_out, first, mask=m_ok[:, None])
        tl.store(q_out + HALF, second, mask=m_ok[:, None])
    else:
        slot = tl.load(slot_ptr + rm, mask=m_ok, other=-1).to(tl.int64)
        ok = (m_ok & (slot >= 0))[:, None]  # a negative slot marks a padding token: nothing is written
        block = (slot // BLOCK_SIZE)[:, None]
        offset = (slot % BLOCK_SIZE)[:, None]
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            kv_head = head - NUM_Q_HEADS
            dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + kv_head * stride_kch + c[None, :]
        else:
            kv_head = head - NUM_Q_HEADS - NUM_KV_HEADS
            dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + kv_head * stride_vch + c[None, :]
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(dst, first.to(cache_dtype), mask=ok)
        tl.store(dst + HALF, second.to(cache_dtype), mask=ok)


def linear_rotary_kv_append(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """See ``reference.linear_rotary_kv_append``. One launch for few rows of whole-head rotary (the
    q/k/v product rounded where it stores, rotary rounded where it rounds); any other case runs the
    product, then ``rotary_kv_append``. ``tiles``: instead of ``QKV_ROTARY_TILES`` (the tile sweep)."""
    rest = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    tiles = _qkv_rotary_tiles(tiles, QKV_ROTARY_TILES, x, k_cache.shape[3] // 2)
    if not (few_row_product(x, weight) and _rotary_fits(tiles, cos_sin_cache, k_cache, v_cache)):
        return _packed_rotary_kv_append(torch.nn.functional.linear(x, weight, bias), *rest)
    return _launch_qkv_rotary(x, weight, None, None, bias, *rest, tiles, x.dtype)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of fp8 q/k/v with rotary: the fastest of the 27 shapes tried
# at one row of Llama-3-8B's q/k/v on an H200, 9.6 us against 11.5 for the fp8 GEMM
# and rotary_kv_append (16-column halves, as the GEMM's 32-row slices, took 16.5)
# (bench/kernels_bench.py --no-attention --fused --sweep fused --gemm-rows 1)
FP8_QKV_ROTARY_TILES = (16, 32, 512, 4, 4)


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
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """See ``reference.fp8_linear_rotary_kv_append``. One launch where ``fp8_linear`` would run its
    Triton GEMM (few rows) on a weight with one scale per output channel: the product scaled and
    rounded as that GEMM stores it, then rotary and the append as in ``linear_rotary_kv_append``; any
    other case runs ``fp8_linear``, then ``rotary_kv_append``. ``tiles``: instead of
    ``FP8_QKV_ROTARY_TILES`` (the tile sweep)."""
    q8, x_scale, dtype = x if isinstance(x, Fp8Rows) else (*quantize_fp8_per_token(x), x.dtype)
    rest = (positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    tiles = _qkv_rotary_tiles(tiles, FP8_QKV_ROTARY_TILES, q8, k_cache.shape[3] // 2)
    rows = q8.shape[0]
    fused = (
        gemm in ("auto", "triton")
        and 0 < rows <= FEW_ROWS
        and scale.shape[1] == 1
        and q8.stride(-1) == 1
        and weight.stride(-1) == 1
        and _rotary_fits(tiles, cos_sin_cache, k_cache, v_cache)
    )
    if not fused:
        qkv = fp8_linear(Fp8Rows(q8, x_scale, dtype), weight, scale, bias, gemm)
        return _packed_rotary_kv_append(qkv, *rest)
    return _launch_qkv_rotary(q8, weight, x_scale, scale, bias, *rest, tiles, dtype)


def _packed_rotary_kv_append(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The unfused path's second step: a packed q/k/v product through ``rotary_kv_append``; returns q."""
    q, k, v = split_qkv(qkv, k_cache.shape[2], k_cache.shape[3])
    return rotary_kv_append(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def _rotary_fits(
    tiles: tuple[int, int, int, int, int],
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Whether the fused kernel's epilogue takes this rotary and cache: whole-head rotary, tiles that
    divide half a head, contiguous rows."""
    half, bn = k_cache.shape[3] // 2, tiles[1]
    return (
        cos_sin_cache.shape[-1] == 2 * half
        and half % bn == 0
        and (bn >= 16 or tiles[0] == 1)  # tl.dot's narrowest tile (the one-row loop has no dot)
        and k_cache.dtype == v_cache.dtype
        and all(t.stride(-1) == 1 for t in (k_cache, v_cache, cos_sin_cache))
    )


def _launch_qkv_rotary(
    x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
    bias: torch.Tensor | None, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, tiles: tuple[int, int, int, int, int],
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """One launch of ``_linear_rotary_kv_append_kernel`` (``_one_row_qkv_rotary_kernel`` for BLOCK_M 1;
    fp8 when given scales); returns q in ``dtype``."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = weight.shape[0] // head_dim - 2 * num_kv_heads
    half = head_dim // 2
    bm, bn, bk, warps, stages = tiles
    m, k = x.shape
    q = torch.empty((m, num_q_heads, head_dim), dtype=dtype, device=x.device)
    fp8 = w_scale is not None
    heads = num_q_heads + 2 * num_kv_heads
    strides = (
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos_sin_cache.stride(0),
    )  # fmt: skip
    if bm == 1:
        assert m == 1, "the one-row kernel takes one row"
        programs = heads * (half // bn)
        _one_row_qkv_rotary_kernel[(programs,)](
            x, weight, x_scale if fp8 else x, w_scale if fp8 else x, bias if bias is not None else x, q,
            k_cache, v_cache, positions, slot_mapping, cos_sin_cache, k, weight.stride(0),
            w_scale.stride(0) if fp8 else 0, *strides,
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_SIZE=block_size,
            HAS_BIAS=bias is not None, FP8=fp8, EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk,
            REDUCE_EACH_STEP=programs >= 4 * _num_sms(x.device), num_warps=warps, num_stages=1,
            PREFETCH_LINES=prefetch_lines(k, PREFETCH_K_TILES * bk) if fp8 else 0, **pdl_launch(x.device),
        )  # fmt: skip
        return q
    _linear_rotary_kv_append_kernel[(heads * (half // bn), triton.cdiv(m, bm))](
        x, weight, x_scale if fp8 else x, w_scale if fp8 else x, bias if bias is not None else x, q,
        k_cache, v_cache, positions, slot_mapping, cos_sin_cache,
        m, k, x.stride(0), weight.stride(0), w_scale.stride(0) if fp8 else 0, *strides,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_SIZE=block_size,
        HAS_BIAS=bias is not None, FP8=fp8, DOT_PREC=_dot_precision(dtype), PROMOTE_K=min(bk, FP8_MMA_K),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **pdl_launch(x.device),
        PREFETCH_LINES=prefetch_lines(k, PREFETCH_K_TILES * bk) if fp8 else 0,  # 16-bit: no gain measured
    )  # fmt: skip
    return q
