"""A gated MLP's gate and up products with its activation in their epilogue, for decode's few rows.

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

from .pdl import pdl_launch, pdl_prologue
from .triton_attention import _dot_precision
from .triton_pointwise import act_and_mul_values, gelu_tanh_and_mul, silu_and_mul
from .triton_quant import few_row_product, gemm_tile

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
    pdl_prologue(PDL)
    rm, rn, m_ok, n_ok = gemm_tile(M, I, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
    gate_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # [1, BN]
    up_cols = gate_cols + I.to(tl.int64) * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        w_mask = k_ok[:, None] & n_ok[None, :]
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        gate = tl.load(gate_cols + k[:, None], mask=w_mask, other=0.0)  # [BK, BN]
        up = tl.load(up_cols + k[:, None], mask=w_mask, other=0.0)
        acc_gate = tl.dot(x, gate, acc_gate, input_precision=DOT_PREC)
        acc_up = tl.dot(x, up, acc_up, input_precision=DOT_PREC)
    dtype = x_ptr.dtype.element_ty
    # why the casts: the unfused product stores gate and up in the input dtype before the activation
    y = act_and_mul_values(acc_gate.to(dtype), acc_up.to(dtype), GELU_TANH)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


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
    bm, bn, bk, warps, stages = tiles or GATED_TILES
    _linear_act_and_mul_kernel[(triton.cdiv(inter, bn), triton.cdiv(m, bm))](
        x, weight, out, m, inter, k, x.stride(0), weight.stride(0), out.stride(0),
        GELU_TANH=gelu_tanh, DOT_PREC=_dot_precision(x.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See ``reference.linear_silu_and_mul``."""
    return linear_act_and_mul(x, weight, gelu_tanh=False)


def linear_gelu_tanh_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See ``reference.linear_gelu_tanh_and_mul``."""
    return linear_act_and_mul(x, weight, gelu_tanh=True)
