"""Fused mixture-of-experts MLP in Triton; twin of ``reference.fused_moe``.

The field's recipe (vLLM's fused_moe, DeepSpeed's MoE scatter + grouped GEMM): the T * k
(token, expert) slots are sorted by expert and each expert's group is padded to a multiple of
BLOCK_M, so every BLOCK_M rows of the sorted list belong to one expert. One grouped-GEMM launch then
runs every expert's GEMM over its own rows at once:

1. ``_moe_gemm_kernel`` with GATED: rows gather their token's hidden state, multiply it by the
   expert's gate and up rows (two accumulators) and store silu(gate) * up: [T * k, I];
2. the same kernel without GATED multiplies those by the expert's down rows and scales each slot by
   its routing weight: [T * k, H];
3. each token's k slots are summed.

The sort (``align_by_expert``) is a handful of torch ops with no host sync, and every launch has a
grid fixed by T alone (an upper bound on the padded block count; blocks past the real count exit at
once), so the whole op can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class ExpertLayout:
    """The slots of a batch sorted by expert, each expert's group padded to a multiple of block_m."""

    sorted_slots: torch.Tensor  # int32 [max_padded]: slot t * k + j, or T * k for padding rows
    block_expert: torch.Tensor  # int32 [max_padded // block_m]: the expert owning each block
    padded_rows: torch.Tensor  # int32 [1]: real padded row count (blocks beyond it hold nothing)
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """Sort the slots of ``topk_ids`` ([T, k]) by expert and pad each expert's group to block_m rows.

    Sizes depend only on T, k, E and block_m (the padded total is bounded by
    T * k + min(E, T * k) * (block_m - 1)), so no value is read back to the host.
    """
    flat = topk_ids.reshape(-1).long()  # [S]: expert of slot s
    num_slots = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)  # [S]: slots grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    first = torch.cumsum(counts, 0) - counts  # [E]: first sorted index of each expert
    expert = flat[order]  # [S]: expert of each sorted slot
    rank = torch.arange(num_slots, device=device) - first[expert]  # position within its expert
    max_padded = triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((max_padded,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[pad_start[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=num_experts - 1)
    return ExpertLayout(
        sorted_slots=sorted_slots,
        block_expert=block_expert.to(torch.int32),
        padded_rows=pad_end[-1:].to(torch.int32),
        block_m=block_m,
    )


@triton.jit(do_not_specialize=["num_slots"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, sorted_slots_ptr, block_expert_ptr, padded_rows_ptr,
    N, K, num_slots, num_blocks_m,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """C[slot, n] = A[slot // A_ROW_DIV] . B[expert(slot), n] for the sorted slots of one block.

    GATED: B holds gate rows [0, N) then up rows [N, 2N); C = silu(A . gate) * (A . up), each
    rounded to C's dtype as the reference rounds. MUL_WEIGHT: C is scaled by the slot's weight.
    """
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row blocks share each column block while it is in L2
    per_group = GROUP_M * num_blocks_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    if pid_m * BLOCK_M >= tl.load(padded_rows_ptr):
        return

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)  # [M]; num_slots marks a padding row
    row_ok = slots < num_slots
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + k[None, :]
    b_ptrs = b_ptr + expert * stride_be + cols[None, :] * stride_bn + k[:, None] * stride_bk  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(tl.cdiv(K, BLOCK_K)):
        k_ok = k < K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    out_ty = c_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        acc = act * acc_up.to(out_ty).to(tl.float32)
    if MUL_WEIGHT:
        # why rounded first: the reference's down projection returns the model dtype
        acc = acc.to(out_ty).to(tl.float32) * tl.load(weight_ptr + slots, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(out_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class MoETiles:
    """Tile sizes of the grouped GEMMs (the decode and prefill regimes want different ones)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def moe_tiles(num_slots: int, num_experts: int, on_gpu: bool) -> MoETiles:
    """Tiles for ``num_slots`` (T * k) rows over ``num_experts``: small row blocks when experts get few
    rows each (decode: the GEMMs are weight reads), large ones for prefill (compute-bound)."""
    if not on_gpu:  # the interpreter: small tiles keep it quick
        return MoETiles(16, 16, 16, 1, 1, 1)
    rows_per_expert = num_slots / num_experts
    if rows_per_expert <= 16:
        return MoETiles(16, 64, 128, 1, 4, 4)
    if rows_per_expert <= 64:
        return MoETiles(32, 64, 128, 4, 4, 4)
    return MoETiles(64, 128, 64, 8, 8, 3)


def _grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor, layout: ExpertLayout,
    n: int, a_row_div: int, gated: bool, tiles: MoETiles,
) -> None:  # fmt: skip
    num_blocks_m = layout.sorted_slots.numel() // tiles.block_m
    grid = (num_blocks_m * triton.cdiv(n, tiles.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, weights, layout.sorted_slots, layout.block_expert, layout.padded_rows,
        n, a.shape[1], c.shape[0], num_blocks_m,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    tiles: MoETiles | None = None,
) -> torch.Tensor:
    """Mixture-of-experts SwiGLU MLP; see ``reference.fused_moe``. ``tiles`` overrides the tile
    choice (for benchmarks)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    for t in (x, w13, w2):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    if num_tokens == 0:
        return torch.empty_like(x)
    num_slots = num_tokens * top_k
    tiles = tiles or moe_tiles(num_slots, num_experts, x.is_cuda)
    layout = align_by_expert(topk_ids, num_experts, tiles.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()  # [S]
    act = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, weights, layout, inter, top_k, True, tiles)
    out = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, weights, layout, hidden, 1, False, tiles)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
