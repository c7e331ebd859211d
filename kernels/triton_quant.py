"""Triton weight-only GEMMs: int8 and FP6 e3m2 weights dequantized inside the GEMM, 16-bit activations.

Twins of ``reference_quant.int8_linear`` / ``fp6_linear``. A program owns a [BLOCK_M, BLOCK_N] tile
of the output; each K step loads the quantized weight tile, turns it into the activation dtype in
registers (int8: a convert; FP6: shifts and a bitcast, see ``fp6_format``), and multiplies on the
tensor cores with float32 accumulation. The per-output-channel scale is applied once, at the end.
One row of an int8 or 16-bit weight goes to ``triton_one_row`` instead (the product on the CUDA cores).

Decode steps (a few rows) are bound by reading the weight, which is where 1 or 0.75 bytes a weight
pays. Large prefill steps are bound by compute: there the weight is dequantized to the activation
dtype once and the product runs in cuBLAS (``DEQUANT_MIN_ROWS``).

``dense_linear``: the same kernel on an unquantized 16-bit weight, for the few-row products where it
beats cuBLAS (see ``DENSE_MAX_ROWS``); ``logits_linear``: the same for the LM head, writing float32
logits in the one launch (see ``LOGITS_TILES``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp6_format import FP6_FP16_FACTOR
from .pdl import pdl_launch, pdl_release, pdl_wait
from .reference_quant import dequantize_weight
from .triton_attention import _dot_precision, _num_sms
from .triton_one_row import one_row_linear, one_row_tiles

# Rows from which a dequantized weight and cuBLAS beat the fused kernel: the dequantization (one read
# of the quantized weight, one write and one read of the 16-bit copy) costs a few percent of a product
# this large, while Triton's mixed-dtype product runs below cuBLAS. To be measured on the GPU
# (bench/quantization_bench.py --gemm).
DEQUANT_MIN_ROWS = 1024


@triton.jit
def _fp6_to_fp16(code):
    """int32 FP6 codes -> fp16 holding each code's value times 2**-12 (exact)."""
    bits = ((code & 0x1F) << 8) | ((code & 0x20) << 10)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def gemm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The output tile of this program of a (N tiles, M tiles) grid: rows, columns and their masks."""
    rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, rm < M, rn < N


@triton.jit
def store_gemm_tile(acc, out_ptr, bias_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS: tl.constexpr):
    """out[rm, rn] = acc (+ bias[rn]), rounded once to the output dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# why do_not_specialize: M changes with every batch; a Triton variant per value class of M would
# compile in the middle of serving
@triton.jit(do_not_specialize=["M"])
def _weight_only_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, scale_factor,
    FP6: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
    ROUND_TO_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    rm, rn, m_ok, n_ok = gemm_tile(M, N, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # [1, BN]
    if FP6:
        pdl_wait(PDL)
        # a K4-range of the three byte planes holds four column ranges of codes (fp6_format)
        k4 = K // 4
        for i0 in range(0, k4, BLOCK_K):
            k = i0 + rk
            k_ok = k < k4
            w_mask = k_ok[:, None] & n_ok[None, :]
            x_mask = m_ok[:, None] & k_ok[None, :]
            wp = w_cols + k[:, None]  # [BK, BN]
            b0 = tl.load(wp, mask=w_mask, other=0).to(tl.int32)
            b1 = tl.load(wp + k4, mask=w_mask, other=0).to(tl.int32)
            b2 = tl.load(wp + 2 * k4, mask=w_mask, other=0).to(tl.int32)
            xp = x_rows + k[None, :]  # [BM, BK]
            x0 = tl.load(xp, mask=x_mask, other=0.0)
            dt = x0.dtype
            acc += tl.dot(x0, _fp6_to_fp16(b0 >> 2).to(dt), input_precision=DOT_PREC)
            x1 = tl.load(xp + k4, mask=x_mask, other=0.0)
            acc += tl.dot(x1, _fp6_to_fp16(b1 >> 2).to(dt), input_precision=DOT_PREC)
            x2 = tl.load(xp + 2 * k4, mask=x_mask, other=0.0)
            acc += tl.dot(x2, _fp6_to_fp16(b2 >> 2).to(dt), input_precision=DOT_PREC)
            x3 = tl.load(xp + 3 * k4, mask=x_mask, other=0.0)
            d = ((b0 & 3) << 4) | ((b1 & 3) << 2) | (b2 & 3)
            acc += tl.dot(x3, _fp6_to_fp16(d).to(dt), input_precision=DOT_PREC)
    else:
        # why a 16-bit weight's first K tile apart: it is read before the wait (see pdl.py), and multiplied
        # after the loop, so the loop's first loads need not wait for it (multiplied before the loop, it
        # made a bf16 step slower); int8 weights stream every tile (held apart, int8 was slower)
        PEEL: tl.constexpr = not SCALED
        first_ok = rk < K
        if PEEL:
            w_first = tl.load(w_cols + rk[:, None], mask=first_ok[:, None] & n_ok[None, :], other=0.0)
        pdl_wait(PDL)
        if PEEL:
            x_first = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & first_ok[None, :], other=0.0)
        for k0 in range(BLOCK_K if PEEL else 0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)  # [BK, BN]
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PREC)
        if PEEL:
            acc += tl.dot(x_first, w_first, input_precision=DOT_PREC)
    pdl_release(PDL)  # why after the loop: see pdl.py
    if SCALED:
        acc *= (tl.load(scale_ptr + rn, mask=n_ok, other=0.0) * scale_factor)[None, :]
    if ROUND_TO_X:  # logits: rounded where the product in x's dtype would be, stored in a wider dtype
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    store_gemm_tile(acc, out_ptr, bias_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS)


def _tiles(m: int, n: int, k: int, element_size: int, fp6: bool, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for an M-row product. One row of an int8 or 16-bit
    weight: BLOCK_M 1 means ``triton_one_row``'s kernel with its tiles (the stages unused). Few rows:
    narrow N tiles so that a weight-bound product has enough programs to keep every SM reading; FP6's
    BLOCK_K counts bytes of one plane (four times as many columns). At 17-64 rows, int8 chooses by the
    grid's size (``INT8_MIDDLE_TILES``); 16-bit and FP6 weights take 64 x 64 tiles. From 65 rows,
    int8 (measured at 256 rows on an H100, ``INT8_WIDE_TILES``): 128 x 64 tiles with a deeper K step
    where they fill the SMs in one wave, 128 x 128 tiles of 8 warps where 128-column tiles fall short
    of one program per SM, 128 x 128 of 4 warps on wider outputs."""
    if m == 1 and not fp6:
        return 1, *one_row_tiles(k, element_size), 1
    if m <= 16:
        return 16, 32, 64 if fp6 else 256, 4, 4
    if m <= 64 and element_size == 1 and not fp6:
        return _int8_middle_tiles(m, n, sms)
    if m <= 64:
        return 64, 64, 32 if fp6 else 128, 4, 4
    if fp6:
        return 128, 128, 32, 8, 3
    narrow, short_grid, wide = INT8_WIDE_TILES
    if triton.cdiv(n, narrow[1]) * triton.cdiv(m, narrow[0]) <= sms:
        return narrow
    if triton.cdiv(n, 128) * triton.cdiv(m, 128) < sms:
        return short_grid
    return wide


# (most rows, programs per SM the narrow tiles may have, narrow tiles, wide tiles) of the int8 GEMM
# at 17-32 rows, then at 33-64. At 32 rows on an H100, us against
# the 64 x 64 x 128 tiles every shape had before (scratch sweep of 8 shapes, docs/BENCHMARKS.md
# 2026-12-06): o_proj 4096 x 4096 12.29 against 22.22, down 4096 x 14336 37.10 against 72.14, qkv
# 6144 x 4096 16.51 against 22.35 (16-row tiles: up to 4 programs per SM), gate_up 28672 x 4096 51.69
# against 64.45 (32 x 64: more would be too many programs); at 64 rows o_proj 18.91 against 23.54 and
# down 60.64 against 77.97 (32 x 64 tiles: one program per SM), while qkv and gate_up, whose 32 x 64
# grids take more than one wave, kept 64 x 64 (23.77 and 66.51, within 0.5% of the sweep's best)
INT8_MIDDLE_TILES = (
    (32, 4, (16, 32, 256, 4, 3), (32, 64, 128, 4, 3)),
    (64, 1, (32, 64, 128, 4, 3), (64, 64, 128, 4, 4)),
)


def _int8_middle_tiles(m: int, n: int, sms: int) -> tuple[int, int, int, int, int]:
    """The int8 GEMM's tiles at 17-64 rows (``INT8_MIDDLE_TILES``): the narrow ones of the first row
    range holding m while their grid has at most its programs per SM, else the wide ones."""
    _, programs_per_sm, narrow, wide = next(entry for entry in INT8_MIDDLE_TILES if m <= entry[0])
    if triton.cdiv(n, narrow[1]) * triton.cdiv(m, narrow[0]) <= programs_per_sm * sms:
        return narrow
    return wide


# (narrow, short grid, wide) tiles of the int8 GEMM from 65 rows. At 256 rows on an H100, us against
# the 8-warp 128 x 128 tiles every shape had before (scratch micro-benchmarks, docs/BENCHMARKS.md):
# o_proj 4096 x 4096 29.8 against 51.8 and down 4096 x 14336 100.2 against 178.5 (narrow: 128
# programs, one wave); qkv 6144 x 4096 keeps the short grid's 51.3 (narrow: 192 programs, 57.1);
# gate_up 28672 x 4096 157.2 against 172.0, the LM head's int8 copy at 128 rows 346.2 against 381.1
INT8_WIDE_TILES = ((128, 64, 128, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4))


def weight_only_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, fp6: bool,
    tiles: tuple[int, int, int, int, int] | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """x @ (weight * scale)^T + bias, the weight int8 or 16-bit (``fp6``: packed FP6 codes; ``scale``
    None: a 16-bit weight used as it is). ``tiles``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    instead of ``_tiles``' choice. ``out_dtype`` (float32, for logits, without a bias): the product
    rounded to x's dtype, stored in this one (x's dtype if None)."""
    m, k = x.shape
    n = weight.shape[0]
    assert scale is None or scale.shape == (n, 1), "weight-only kernels take one scale per output channel"
    out_dtype = out_dtype or x.dtype
    assert out_dtype == x.dtype or bias is None, "the bias would be added before the rounding to x's dtype"
    if m >= DEQUANT_MIN_ROWS:
        w = weight if scale is None else dequantize_weight(weight, scale, x.dtype)
        return torch.nn.functional.linear(x, w, bias).to(out_dtype)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1, "the last dimension must be contiguous"
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=x.device)
    bm, bn, bk, warps, stages = tiles or _tiles(m, n, k, weight.element_size(), fp6, _num_sms(x.device))
    if bm == 1:
        assert m == 1 and not fp6, "the one-row kernel takes one row of an int8 or 16-bit weight"
        return one_row_linear(x, weight, scale, bias, None, out_dtype, (bn, bk, warps))
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _weight_only_gemm_kernel[grid](
        x, weight, scale if scale is not None else x, bias if bias is not None else x, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), FP6_FP16_FACTOR if fp6 else 1.0,
        FP6=fp6, SCALED=scale is not None, HAS_BIAS=bias is not None, DOT_PREC=_dot_precision(x.dtype),
        ROUND_TO_X=out_dtype != x.dtype, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """See ``reference_quant.int8_linear``."""
    return weight_only_linear(x, weight, scale, bias, fp6=False)


def fp6_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """See ``reference_quant.fp6_linear``."""
    return weight_only_linear(x, weight, scale, bias, fp6=True)


# dense_linear's Triton regime: one row (``triton_one_row``), and 2 to 16 rows (a product that only
# reads its weight) of an output narrow enough that its 32-row weight slices give at most one program
# per SM, where cuBLAS splits K and adds a reduce launch. At 16 rows on an H200 (bench/kernels_bench.py
# --gemm): o_proj 4096 x 4096 11.5 us against cuBLAS's 14.0, down 4096 x 14336 31.5 against 33.5;
# qkv (with rotary) and gate_up (with its activation) go to triton_fused_linear
DENSE_MAX_ROWS = 16
DENSE_TILES = (16, 32, 512, 4, 3)


def few_row_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [M, K] @ weight [N, K]^T is a product of decode's few rows (``DENSE_MAX_ROWS``), laid
    out as the few-row 16-bit kernels take it (here and in ``triton_fused_linear``)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= DENSE_MAX_ROWS
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and weight.dtype == x.dtype
    )


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in x's dtype: see ``reference.dense_linear``. One row, whatever N:
    ``triton_one_row`` (at one row of Llama-3-8B's qkv, 13.81 us against cuBLAS's 15.46)."""
    if not few_row_product(x, weight):
        return torch.nn.functional.linear(x, weight)
    if x.shape[0] == 1:
        return weight_only_linear(x, weight, None, None, False)
    if triton.cdiv(weight.shape[0], DENSE_TILES[1]) > _num_sms(x.device):
        return torch.nn.functional.linear(x, weight)
    return weight_only_linear(x, weight, None, None, False, fit_k_step(DENSE_TILES, x.element_size()))


# logits_linear's tiles from 2 rows: 128-column slices, many waves of them (the head has ~4,000 at
# 32k-plus vocabularies). One row takes ``triton_one_row``'s: Llama-3-8B's head (128,256 x 4,096) on an
# H100, 334.3 us against 344.0 for these tiles and 377.8 for cuBLAS and the float cast
# (bench/kernels_bench.py --no-attention --logits --sweep logits --gemm-rows 1)
LOGITS_TILES = (16, 128, 128, 4, 3)


def logits_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """float32 logits of x [M, K] @ weight [N, K]^T: see ``reference.logits_linear``. ``scale``: an int8
    head's [N, 1] (``quantization.lm_head``), whose product runs in ``weight_only_linear`` at any row count.
    ``tiles``: instead of the one-row kernel's (one row) or ``LOGITS_TILES`` (for the tile sweep)."""
    if scale is not None:
        return weight_only_linear(x, weight, scale, None, False, out_dtype=torch.float32)
    if not few_row_product(x, weight):
        return torch.nn.functional.linear(x, weight).float()
    if tiles is not None or x.shape[0] > 1:
        tiles = fit_k_step(tiles or LOGITS_TILES, x.element_size())
    return weight_only_linear(x, weight, None, None, False, tiles, out_dtype=torch.float32)


def fit_k_step(
    tiles: tuple[int, int, int, int, int], element_size: int
) -> tuple[int, int, int, int, int]:
    """A few-row GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), given for 16-bit values, with the K
    step halved for 4-byte ones, whose stages and first tile held apart (see
    ``_weight_only_gemm_kernel``) would not fit in shared memory."""
    bm, bn, bk, warps, stages = tiles
    return bm, bn, bk * 2 // max(element_size, 2), warps, stages
