"""Skinny matmul: ``y = x W^T (+ b)`` for a handful of rows, where reading W is all the work.

At decode batch 1..16 a linear layer is a matrix-vector product bound by the weight read. cuBLAS
reaches ~97% of HBM bandwidth on the large MLP matrices of a Llama-3-8B layer, but ~75% on the
smaller q/k/v and output projections, plus a split-K reduce launch for the latter (measured on an
H200: 15.2 and 10.8 + 1.7 us against floors of 11.9 and 7.9 us). This kernel gives each program a
slice of output columns and the whole reduction, with enough loads in flight per SM to stream W at
full rate; rows beyond ``SKINNY_MAX_ROWS`` go to cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SKINNY_MAX_ROWS = 16  # tl.dot's smallest M: every row count up to it costs one weight read


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, num_rows, n_out, k_in, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS_PAD)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < n_out
    row_ok = rows < num_rows
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + ks) < k_in
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if ROWS_PAD == 1:  # one row: a dot product per column on the CUDA cores
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 16,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)``; see ``reference.linear``. x: [..., K]; weight: [N, K]."""
    k_in = x.shape[-1]
    n_out = weight.shape[0]
    x2 = x.reshape(-1, k_in)
    num_rows = x2.shape[0]
    if num_rows > SKINNY_MAX_ROWS or num_rows == 0 or weight.stride(-1) != 1:
        return F.linear(x, weight, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((num_rows, n_out), dtype=x.dtype, device=x.device)
    _skinny_matmul_kernel[(triton.cdiv(n_out, block_n),)](
        x2, weight, weight if bias is None else bias, out, num_rows, n_out, k_in,
        x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ROWS_PAD=1 if num_rows == 1 else SKINNY_MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k_in % block_k == 0, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n_out)
