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

The sort (``align_by_expert``) is one single-program launch, the router's softmax and top-k
(``moe_route``, an op of its own) another; no value goes back to the host and every grid is fixed by
T alone (the GEMMs' by an upper bound on the padded block count; blocks past the real count exit at
once), so a MoE layer can be captured in a CUDA graph. Each layer costs six launches besides its
router GEMM: route, fill, align, the two grouped GEMMs and the sum over k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_attention import _num_sms


@dataclass(frozen=True)
class ExpertLayout:
    """The slots of a batch sorted by expert, each expert's group padded to a multiple of block_m."""

    sorted_slots: torch.Tensor  # int32 [max_padded]: slot t * k + j, or T * k for padding rows
    block_expert: torch.Tensor  # int32 [max_padded // block_m]: the expert owning each block
    padded_rows: torch.Tensor  # int32 [1]: real padded row count (blocks beyond it hold nothing)
    block_m: int


@triton.jit(do_not_specialize=["num_slots", "num_blocks"])
def _align_kernel(
    ids_ptr, sorted_slots_ptr, block_expert_ptr, padded_rows_ptr, num_slots, num_blocks,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: count each expert's slots, pad the counts to BLOCK_M, name each block's expert,
    and scatter every slot to its place (slots of one expert keep their order)."""
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        slot = start + lanes
        expert = tl.load(ids_ptr + slot, mask=slot < num_slots, other=E_PAD)  # E_PAD matches no column
        counts += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E]
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    tl.store(padded_rows_ptr, tl.sum(padded, axis=0))
    for start in range(0, num_blocks, CHUNK):
        block = start + lanes
        # a block's expert: the number of experts whose padded group ends at or before it
        owner = tl.sum((pad_end[None, :] <= (block * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + block, tl.minimum(owner, NUM_EXPERTS - 1), mask=block < num_blocks)
    seen = tl.zeros([E_PAD], dtype=tl.int32)  # slots of each expert placed by earlier chunks
    for start in range(0, num_slots, CHUNK):
        slot = start + lanes
        expert = tl.load(ids_ptr + slot, mask=slot < num_slots, other=E_PAD)
        hit = (expert[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E]
        before = tl.cumsum(hit, axis=0) - hit  # earlier slots of the same expert in this chunk
        dest = tl.sum(hit * (before + seen[None, :] + pad_start[None, :]), axis=1)
        tl.store(sorted_slots_ptr + dest, slot, mask=slot < num_slots)
        seen += tl.sum(hit, axis=0)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """Sort the slots of ``topk_ids`` ([T, k]) by expert and pad each expert's group to block_m rows.

    Sizes depend only on T, k, E and block_m (the padded total is bounded by
    T * k + min(E, T * k) * (block_m - 1)), so no value is read back to the host.
    """
    ids = topk_ids.reshape(-1)  # [S]: expert of slot s
    num_slots = ids.numel()
    max_padded = triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((max_padded,), num_slots, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=ids.device)
    padded_rows = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_pad = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](
        ids, sorted_slots, block_expert, padded_rows, num_slots, block_expert.numel(),
        NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=max(16, min(256, 4096 // e_pad)),
        num_warps=4,
    )  # fmt: skip
    return ExpertLayout(sorted_slots=sorted_slots, block_expert=block_expert, padded_rows=padded_rows, block_m=block_m)


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, stride_t,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < num_tokens
    x = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
        mask=row_ok[:, None] & (cols < NUM_EXPERTS)[None, :],
        other=float("-inf"),
    ).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # padding rows: finite, never stored
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]  # [T, E] softmax in float32
    total = tl.zeros([BLOCK_T], dtype=tl.float32) + 1.0
    if NORMALIZE:  # a first pass for the top-k sum (cheap: k maxima over E values)
        left = probs
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        for _ in tl.static_range(TOP_K):
            best = tl.max(left, axis=1)
            first = tl.min(tl.where(left == best[:, None], cols[None, :], E_PAD), axis=1)
            total += best
            left = tl.where(cols[None, :] == first[:, None], -1.0, left)
    left = probs
    for j in tl.static_range(TOP_K):  # descending, ties to the lower expert id
        best = tl.max(left, axis=1)
        first = tl.min(tl.where(left == best[:, None], cols[None, :], E_PAD), axis=1)
        tl.store(weights_ptr + rows * TOP_K + j, best / total, mask=row_ok)
        tl.store(ids_ptr + rows * TOP_K + j, first.to(tl.int64), mask=row_ok)
        left = tl.where(cols[None, :] == first[:, None], -1.0, left)


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts and the top-k; see ``reference.moe_route``. One launch."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(-1) == 1, "the last dimension must be contiguous"
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        e_pad = triton.next_power_of_2(num_experts)
        block_t = max(1, min(64, 4096 // e_pad))
        _route_kernel[(triton.cdiv(num_tokens, block_t),)](
            router_logits, weights, ids, num_tokens, router_logits.stride(0),
            NUM_EXPERTS=num_experts, E_PAD=e_pad, TOP_K=top_k, NORMALIZE=normalize, BLOCK_T=block_t,
        )  # fmt: skip
    return weights, ids


@triton.jit(do_not_specialize=["num_slots", "num_blocks_m"])
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
    n: int, a_row_div: int, gated: bool, tiles: MoETiles, adapt: bool,
) -> None:  # fmt: skip
    num_blocks_m = layout.sorted_slots.numel() // tiles.block_m
    block_n = tiles.block_n
    if adapt and a.is_cuda:
        # why: a decode step has a block or two per expert; narrower columns keep every SM streaming
        # weights (e.g. the down projection at batch 1: 2 blocks x 4096 / 64 = 128 programs)
        while block_n > 32 and num_blocks_m * triton.cdiv(n, block_n) < 2 * _num_sms(a.device):
            block_n //= 2
    grid = (num_blocks_m * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, weights, layout.sorted_slots, layout.block_expert, layout.padded_rows,
        n, a.shape[1], c.shape[0], num_blocks_m,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
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
    choice, exactly (for benchmarks)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    for t in (x, w13, w2):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    if num_tokens == 0:
        return torch.empty_like(x)
    num_slots = num_tokens * top_k
    adapt = tiles is None  # given tiles are used as they are
    tiles = tiles or moe_tiles(num_slots, num_experts, x.is_cuda)
    layout = align_by_expert(topk_ids, num_experts, tiles.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()  # [S]
    act = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, weights, layout, inter, top_k, True, tiles, adapt)
    out = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, weights, layout, hidden, 1, False, tiles, adapt)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
