"""fp8 (e4m3) linear on the GPU: per-token activation quantization, then one of two GEMMs.

Twin of ``reference_quant.fp8_linear``. ``quantize_fp8_per_token`` is one Triton launch (a program per
token: absmax pass, then the scaled cast). The product runs either

- ``scaled_mm``: ``torch._scaled_mm`` (cuBLASLt's fp8 GEMM) with row-wise scales, for weights with
  one scale per output channel; or
- ``triton``: ``_fp8_gemm_kernel``, fp8 x fp8 -> fp32 on the tensor cores, scales applied in the
  epilogue; it also takes group-wise weight scales (HF fine-grained fp8: a scale per 128 x 128
  block, expanded to one per row and 128 columns), applied to each K step's partial product. At one
  row, ``triton_one_row`` instead: the same product on the CUDA cores (see ``_tiles``).

``gemm="auto"`` uses the Triton kernel for up to 32 rows (decode at small batch) and ``scaled_mm`` above,
where it applies (see ``fp8_linear``). Both need
compute capability 8.9 or newer (fp8 tensor cores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_prefetch_rows, pdl_prologue, prefetch_lines
from .reference_quant import FP8_MAX, FP8_SCALE_FLOOR, Fp8Rows
from .triton_attention import _num_sms
from .triton_one_row import one_row_linear, one_row_tiles
from .triton_pointwise import to_fp8
from .triton_quant import gemm_tile, store_gemm_tile

FP8_GEMMS = ("auto", "triton", "scaled_mm")
TRITON_MAX_ROWS = 32  # gemm="auto": the Triton GEMM up to here, torch._scaled_mm above (see fp8_linear)
FEW_ROWS = 16  # the Triton GEMM's weight-bound tile regime (see _tiles)
FP8_MMA_K = 32  # the K of one Hopper fp8 wgmma: accumulation is promoted to fp32 after each
PREFETCH_K_TILES = 2  # few rows: K tiles of the weight asked of L2 before the PDL wait (see pdl.py)


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q,
    FLOOR: tl.constexpr, MAX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), FLOOR) / MAX
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        ok = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + k0 + cols, to_fp8(x, scale, MAX), mask=ok)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``reference_quant.quantize_fp8_per_token``."""
    assert x.stride(-1) == 1, "the last dimension must be contiguous"
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(k), 4096)
        _quantize_per_token_kernel[(m,)](
            x, q, scale, k, x.stride(0), q.stride(0), FLOOR=FP8_SCALE_FLOOR, MAX=FP8_MAX, BLOCK=block,
            num_warps=min(8, max(1, block // 512)), **pdl_launch(x.device),
        )  # fmt: skip
    return q, scale


# why do_not_specialize: M changes with every batch (see triton_quant)
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    q_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_qm, stride_wn, stride_ws, stride_om,
    GROUP_K: tl.constexpr, PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE_K: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    rm, rn, m_ok, n_ok = gemm_tile(M, N, BLOCK_M, BLOCK_N)
    # the last tile's spare columns prefetch a real row
    pdl_prefetch_rows(w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn, PREFETCH_LINES, PDL)
    pdl_prologue(PDL)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        a = tl.load(q_ptr + rm[:, None] * stride_qm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        # why max_num_imprecise_acc: on sm_90 Triton lets fp8 wgmma accumulate a whole K in the tensor
        # cores' reduced-precision adder (~14 bits); promoting every PROMOTE_K products to fp32 keeps
        # the reference's accuracy (4096-deep products were off by 30 fp16 ulps without it)
        if PER_GROUP:  # BLOCK_K divides GROUP_K: one weight scale per output column in this step
            w_scale = tl.load(w_scale_ptr + rn * stride_ws + k0 // GROUP_K, mask=n_ok, other=0.0)
            acc += tl.dot(a, b, max_num_imprecise_acc=PROMOTE_K) * w_scale[None, :]
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_K)
    if not PER_GROUP:
        acc = acc * tl.load(w_scale_ptr + rn * stride_ws, mask=n_ok, other=0.0)[None, :]
    acc = acc * tl.load(x_scale_ptr + rm, mask=m_ok, other=0.0)[:, None]
    store_gemm_tile(acc, out_ptr, bias_ptr, rm, rn, m_ok, n_ok, stride_om, HAS_BIAS)


def _tiles(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): narrow N tiles for few rows (weight-bound: many
    programs reading), square tiles for many (compute-bound).

    Few rows: each program streams a 32-row slice of the weight, with a K step that keeps enough
    bytes in flight for the grid's size: 256 columns when there are 4 or more programs per SM, else
    512, or 1024 for deep products (K >= 8192). Swept at one row on an H200 over Llama-3-8B's shapes
    (``bench/kernels_bench.py --sweep gemm``): 70 us per layer against 86 with one 32 x 256 tile for
    all (docs/BENCHMARKS.md).

    One row: BLOCK_M 1 means ``triton_one_row``'s kernel with its tiles (BLOCK_N, BLOCK_K, warps; the
    stages are unused). At one row on an H200, CUDA-graph replay over 8 weight copies, its tiles
    against the tensor-core ones above: o_proj 6.31 us against 8.56, gate_up 31.84 against 37.32,
    down 16.86 against 20.65; the best of 35 shapes was within 0.45 us of them on each
    (docs/BENCHMARKS.md 2026-12-05).

    17-32 rows: one 32-row slice of the batch, so each program reads its weight slice once for all
    the rows: 32 x 32 tiles (a K step of 512, 256 from 2 programs per SM) while the grid holds fewer
    than 4 programs per SM, else 32 x 64. With them ``fp8_linear`` routes these rows to this kernel
    instead of ``torch._scaled_mm``. On an H100, in one call, fp8 decode steps of 24 sequences took
    5.64-5.67 ms against 5.79 with two 16-row slices, of 32 5.96-5.97 against 6.35-6.45; scaled_mm
    took 6.27 and 6.94 on another H100 (docs/BENCHMARKS.md 2026-12-06 and 2026-12-07)."""
    if m == 1:
        return 1, *one_row_tiles(k, 1), 1
    if m <= FEW_ROWS:
        if triton.cdiv(n, 32) >= 4 * sms:
            return 16, 32, 256, 4, 3
        return 16, 32, 1024 if k >= 8192 else 512, 4, 3
    if m <= 2 * FEW_ROWS:
        programs = triton.cdiv(n, 32)  # each reads its weight slice once, for all the rows
        if programs >= 4 * sms:
            return 32, 64, 128, 4, 4
        return 32, 32, 256 if programs >= 2 * sms else 512, 4, 3
    if m <= 64:
        return 64, 64, 128, 4, 4
    return 128, 128, 128, 8, 3


def fp8_gemm_triton(
    q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """(q [M, K] fp8, x_scale [M]) @ (weight [N, K] fp8, scale [N, G])^T + bias -> [M, N].
    ``tiles``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) instead of ``_tiles``' choice (benchmarks)."""
    m, k = q.shape
    n, groups = scale.shape
    bm, bn, bk, warps, stages = tiles or _tiles(m, n, k, _num_sms(q.device))
    if bm == 1 and m == 1:
        return one_row_linear(q, weight, scale, bias, x_scale, out_dtype, (bn, bk, warps))
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    assert bm > 1, "the one-row kernel takes one row"
    group_k = -(-k // groups)
    if groups > 1:
        bk = min(bk, group_k)
        assert group_k % bk == 0, "fp8 weight scale groups must be a multiple of 16 columns"
    prefetch = prefetch_lines(k, PREFETCH_K_TILES * bk) if m <= FEW_ROWS else 0
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _fp8_gemm_kernel[grid](
        q, x_scale, weight, scale, bias if bias is not None else scale, out,
        m, n, k, q.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        GROUP_K=group_k, PER_GROUP=groups > 1, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PROMOTE_K=min(bk, FP8_MMA_K), num_warps=warps, num_stages=stages,
        PREFETCH_LINES=prefetch, **pdl_launch(q.device),
    )  # fmt: skip
    return out


def fp8_gemm_scaled_mm(
    q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The same product through ``torch._scaled_mm`` with row-wise scales (scale: [N, 1]).
    ``fast_accum``: sums kept in the tensor cores' narrower accumulator instead of promoted to float32
    as the K loop runs, as vLLM's CUTLASS fp8 kernels keep them (benchmarks: ``kernels_bench --gemm``).
    The model keeps float32 sums: on an H100, fast ones made gate_up at 256 rows 17% faster at 1.7x
    the error, but neither the 256-row decode step nor throughput moved (docs/BENCHMARKS.md 2026-12-07)."""
    # why bfloat16 out: cuBLASLt's row-wise scaled fp8 GEMM writes bf16 only
    y = torch._scaled_mm(
        q, weight.t(), scale_a=x_scale[:, None], scale_b=scale.view(1, -1), out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )  # fmt: skip
    if bias is not None:
        y = y + bias
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def fp8_linear(
    x: torch.Tensor | Fp8Rows,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemm: str = "auto",
) -> torch.Tensor:
    """See ``reference_quant.fp8_linear``; ``gemm``: auto, triton or scaled_mm (scaled_mm needs one
    weight scale per output channel and falls back to the Triton kernel for group-wise scales).

    ``auto``: the Triton kernel up to ``TRITON_MAX_ROWS`` rows, where a step mostly reads weights and its
    narrow tiles keep more of HBM busy, and ``scaled_mm`` above. Measured on one H200 (Llama-3-8B shape,
    docs/BENCHMARKS.md 2026-12-02): batch-1 decode 4.02 ms/token with Triton against 5.11 with
    scaled_mm; 256 x 512 / 256 throughput 13,126 tok/s with scaled_mm against 8,622 with Triton.
    17-32 rows were measured end to end with Triton's tiles for them (see ``_tiles``); from 33 rows
    only a blunt try was, 64 x 64 tiles up to 64 rows, slower than scaled_mm (BENCHMARKS 2026-12-06).
    ``x`` given as ``Fp8Rows`` (from ``rms_norm_fp8``) skips the quantizer's launch, as does one
    16-bit row for the Triton GEMM: the one-row kernel quantizes it as it reads it."""
    if not isinstance(x, Fp8Rows) and x.shape[0] == 1 and gemm != "scaled_mm":
        return one_row_linear(x, weight, scale, bias, quantize_x=True)
    q, x_scale, dtype = x if isinstance(x, Fp8Rows) else (*quantize_fp8_per_token(x), x.dtype)
    use_triton = gemm == "triton" or (gemm == "auto" and q.shape[0] <= TRITON_MAX_ROWS)
    if not use_triton and scale.shape[1] == 1:
        return fp8_gemm_scaled_mm(q, x_scale, weight, scale, bias, dtype)
    return fp8_gemm_triton(q, x_scale, weight, scale, bias, dtype)
