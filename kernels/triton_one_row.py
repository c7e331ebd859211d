"""Products of one row on the CUDA cores: x [1, K] @ weight [N, K]^T, batch-1 decode's linears.

At one row a tensor-core tile computes 16 rows of which 15 are padding, and the narrow tiles a
weight-bound product needs to spread over every SM keep fewer bytes in flight than a plain loop. Here
a program owns ``BLOCK_N`` rows of the weight and walks K in ``BLOCK_K`` steps, multiplying each
weight by its x in float32 (exact for two 16-bit or 8-bit values) and summing in float32.

Weights: 16-bit (x's dtype, or float32), int8 with a scale per output channel, or fp8 e4m3 with a
scale per output channel or per 128-column group (x then fp8 too, with its row's scale, or 16-bit and
quantized per token in the kernel: every program finds the row's scale itself, which spares the
quantizer's launch). The tiles
(``one_row_tiles``) were swept at one row on an H200 over Llama-3-8B's products (docs/BENCHMARKS.md
2026-12-05): 64 weights per thread a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_prefetch_rows, pdl_prologue, pdl_release, pdl_wait, prefetch_lines
from .reference_quant import FP8_MAX, FP8_SCALE_FLOOR
from .triton_attention import _num_sms
from .triton_pointwise import to_fp8

ONE_ROW_K_STEP = 1024  # columns a step, for weights of 1 or 2 bytes
PREFETCH_K_STEPS = 2  # 8-bit weights: K steps of each row asked of L2 before the PDL wait (see pdl.py)
_FP8_SCALE_FLOOR = tl.constexpr(FP8_SCALE_FLOOR)  # jit code reads module globals only as constexprs
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def fp8_row_scale(x_ptr, K, BLOCK_K: tl.constexpr):
    """The per-token fp8 scale of the 16-bit row x [K], as ``quantize_fp8_per_token`` computes it.
    Every program makes this pass; gathering the absmax by atomics in the kernel that wrote x was
    slower on an H100 (docs/BENCHMARKS.md 2026-12-07, twenty-seventh session)."""
    rk = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)))
    return tl.maximum(tl.max(amax, 0), _FP8_SCALE_FLOOR) / _FP8_MAX


@triton.jit
def row_sums(
    x_ptr, rows, scale_rows, K, GROUP_K: tl.constexpr, PER_GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr, REDUCE_EACH_STEP: tl.constexpr, x_fp8_scale, QUANTIZE_X: tl.constexpr,
):  # fmt: skip
    """[R] float32: sum_k x[k] w[r, k] for the R weight rows ``rows`` points at, each product in
    float32 on the CUDA cores. ``PER_GROUP`` (BLOCK_K divides GROUP_K): each K step's sums times its
    group's scale, ``scale_rows`` [R] pointing at each row's scales. ``REDUCE_EACH_STEP``: summed each
    step (few registers: more programs resident), else once after the loop (fewer shuffles).
    ``QUANTIZE_X``: each x first rounded to fp8 at ``x_fp8_scale`` (the sums are then of the codes)."""
    rk = tl.arange(0, BLOCK_K)
    if REDUCE_EACH_STEP or PER_GROUP:
        acc = tl.zeros([rows.shape[0]], dtype=tl.float32)
    else:
        acc = tl.zeros([rows.shape[0], BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            x = tl.load(x_ptr + k)
            w = tl.load(rows[:, None] + k[None, :])
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            w = tl.load(rows[:, None] + k[None, :], mask=(k < K)[None, :], other=0.0)
        x = x.to(tl.float32)
        if QUANTIZE_X:
            x = to_fp8(x, x_fp8_scale, _FP8_MAX).to(tl.float32)
        products = w.to(tl.float32) * x[None, :]
        if PER_GROUP:
            acc += tl.sum(products, 1) * tl.load(scale_rows + k0 // GROUP_K)
        elif REDUCE_EACH_STEP:
            acc += tl.sum(products, 1)
        else:
            acc += products
    return acc if REDUCE_EACH_STEP or PER_GROUP else tl.sum(acc, 1)


@triton.jit
def _one_row_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, N, K, stride_wn, stride_ws,
    X_SCALED: tl.constexpr, QUANTIZE_X: tl.constexpr, W_SCALED: tl.constexpr, GROUP_K: tl.constexpr,
    PER_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, ROUND_TO_X: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_EACH_STEP: tl.constexpr,
    RELEASE_AFTER_LOOP: tl.constexpr, PREFETCH_LINES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[rn] = (sum_k x[k] w[rn, k]) * w_scale[rn] * x_scale (+ bias[rn]), one rounding at the end
    (``ROUND_TO_X``: to x's dtype first, then stored in out's wider one). ``QUANTIZE_X``: x_scale is
    the row's fp8 scale, found here, and x's values are rounded to fp8 at it as they load."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    # the last tile's spare rows read a real row, and their results are not stored
    safe_rn = tl.minimum(rn, N - 1)
    rows = w_ptr + safe_rn.to(tl.int64) * stride_wn
    # why two PDL orders: 16-bit GEMMs released at their start lost SM slots to their dependents, and
    # the L2 hint made them slower; the 8-bit ones gained from both (see pdl.py)
    if RELEASE_AFTER_LOOP:
        pdl_wait(PDL)
    else:
        pdl_prefetch_rows(rows, PREFETCH_LINES, PDL)
        pdl_prologue(PDL)
    if QUANTIZE_X:
        x_scale = fp8_row_scale(x_ptr, K, BLOCK_K)
    elif X_SCALED:
        x_scale = tl.load(x_scale_ptr)
    else:
        x_scale = 1.0
    y = row_sums(x_ptr, rows, w_scale_ptr + safe_rn * stride_ws, K, GROUP_K, PER_GROUP, EVEN_K, BLOCK_K,
                 REDUCE_EACH_STEP, x_scale, QUANTIZE_X)  # fmt: skip
    if RELEASE_AFTER_LOOP:
        pdl_release(PDL)
    if W_SCALED and not PER_GROUP:
        y = y * tl.load(w_scale_ptr + rn * stride_ws, mask=n_ok, other=0.0)
    if X_SCALED or QUANTIZE_X:
        y = y * x_scale
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if ROUND_TO_X:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def one_row_tiles(k: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) for a weight of ``element_size`` bytes: 8 rows by 1,024 columns on 4
    warps for 8-bit weights, 16 rows on 8 warps for 16-bit ones (64 weights a thread either way; K
    steps of 512 for float32). At one row on an H200, CUDA-graph replay (docs/BENCHMARKS.md
    2026-12-05), against the tensor-core tiles: fp8 o_proj 6.31 us against 8.56, down 16.86 against
    20.65; int8 o_proj 8.18 against 9.75, down 22.73 against 27.95; bf16 o_proj 10.22 against 12.34,
    down 28.86 against 31.55."""
    size = min(element_size, 2)
    block_k = ONE_ROW_K_STEP * 2 // max(element_size, 2) if element_size > 1 else ONE_ROW_K_STEP
    return 8 * size, min(block_k, triton.next_power_of_2(k)), 4 * size


def one_row_linear(
    x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    tiles: tuple[int, int, int] | None = None, quantize_x: bool = False,
) -> torch.Tensor:  # fmt: skip
    """x [1, K] @ (weight [N, K] * w_scale [N, G])^T * x_scale + bias -> [1, N] in ``out_dtype`` (x's
    dtype if None). ``x_scale`` [1]: x holds fp8 values of that scale. ``quantize_x`` (fp8 weights): x
    is 16-bit, quantized per token here as ``quantize_fp8_per_token`` would. An unscaled x with a wider
    ``out_dtype`` (logits) has the product rounded to x's dtype first. ``tiles``: (BLOCK_N, BLOCK_K,
    warps) instead of ``one_row_tiles``' choice (benchmarks)."""
    assert x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1, "one contiguous row"
    k = x.shape[1]
    n = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    out = torch.empty((1, n), dtype=out_dtype, device=x.device)
    bn, bk, warps = tiles or one_row_tiles(k, weight.element_size())
    groups = 1 if w_scale is None else w_scale.shape[1]
    group_k = -(-k // groups)
    if groups > 1:
        bk = min(bk, group_k)
        assert group_k % bk == 0, "weight scale groups must be a multiple of 16 columns"
    programs = triton.cdiv(n, bn)
    eight_bit = weight.element_size() == 1
    # why: summing each step's products keeps few registers, so more of a wide grid's programs are
    # resident; a narrow grid has few programs per SM anyway and sums once, after the loop
    _one_row_kernel[(programs,)](
        x, x_scale if x_scale is not None else x, weight, w_scale if w_scale is not None else x,
        bias if bias is not None else x, out, n, k, weight.stride(0), 0 if w_scale is None else w_scale.stride(0),
        X_SCALED=x_scale is not None, QUANTIZE_X=quantize_x, W_SCALED=w_scale is not None, GROUP_K=group_k,
        PER_GROUP=groups > 1, HAS_BIAS=bias is not None,
        ROUND_TO_X=x_scale is None and not quantize_x and out_dtype != x.dtype, EVEN_K=k % bk == 0,
        BLOCK_N=bn, BLOCK_K=bk, REDUCE_EACH_STEP=programs >= 4 * _num_sms(x.device),
        RELEASE_AFTER_LOOP=not eight_bit, PREFETCH_LINES=prefetch_lines(k, PREFETCH_K_STEPS * bk) if eight_bit else 0,
        num_warps=warps, num_stages=1, **pdl_launch(x.device),
    )  # fmt: skip
    return out
