"""The ops the model families beyond Llama need, Triton against the pure-PyTorch reference: sliding
windows and logit soft-capping in paged attention, the plain KV append, GeGLU, and the
mixture-of-experts router and fused MLP (partial rotary: test_triton_ops.test_rotary_kv_append).

On CUDA: bf16/fp16 at model-like shapes. On the CPU: Triton's interpreter (``TRITON_INTERPRET=1``,
set by conftest.py) at tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_ops import (
    ATTN_TOL,
    DEVICE,
    DTYPES,
    MIXED_CASES,
    ON_GPU,
    ULP_TOL,
    _ragged_batch,
    _rand,
)

from mii_server.kernels import reference, triton_attention, triton_moe, triton_ops

# (sliding window, logit soft-cap): windows shorter and longer than the contexts, with and without a cap
OPTIONS = (
    [(1, 0.0), (5, 0.0), (16, 3.0), (0, 3.0), (100, 0.0)]
    if not ON_GPU
    else [(1, 0.0), (64, 0.0), (500, 30.0), (0, 50.0), (4096, 0.0)]
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _attention_case(case, dtype, decode_only: bool):
    num_q_heads, num_kv_heads, head_dim, block_size, seqs = case
    if decode_only:
        seqs = [(1, ctx) for _, ctx in seqs if ctx]
    k_cache, v_cache, meta = _ragged_batch(seqs, num_kv_heads, head_dim, block_size, dtype)
    q = _rand(sum(n for n, _ in seqs), num_q_heads, head_dim, dtype=dtype) * 2
    return q, k_cache, v_cache, meta, head_dim**-0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MIXED_CASES)
@pytest.mark.parametrize(("window", "softcap"), OPTIONS)
@pytest.mark.parametrize("decode_only", [False, True])
def test_paged_attention_window_and_softcap(dtype, case, window, softcap, decode_only) -> None:
    q, k_cache, v_cache, meta, scale = _attention_case(case, dtype, decode_only)
    options = {"sliding_window": window, "logit_softcap": softcap}
    out = triton_ops.paged_attention(q, k_cache, v_cache, meta, scale, **options)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale, **options)
    torch.testing.assert_close(out, expected, **ATTN_TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_windowed_decode_splits_agree(num_splits: int) -> None:
    """Splits cover only the window's tiles; every split count gives the reference's answer."""
    dtype = DTYPES[0]
    seqs = [(1, c) for c in ((1, 40, 130, 2000) if ON_GPU else (1, 9, 30, 45))]
    k_cache, v_cache, meta = _ragged_batch(seqs, 2, 64 if ON_GPU else 16, 16 if ON_GPU else 4, dtype)
    q = _rand(len(seqs), 8, k_cache.shape[-1], dtype=dtype)
    window = 100 if ON_GPU else 7
    out = triton_attention.paged_decode_attention(
        q, k_cache, v_cache, meta, 0.25, sliding_window=window, num_splits=num_splits
    )
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.25, sliding_window=window)
    torch.testing.assert_close(out, expected, **ATTN_TOL[dtype])


def test_reference_window_is_a_band() -> None:
    """The reference's window: position i sees i - W + 1 .. i (Hugging Face's kv > q - W)."""
    seqs = [(6, 6)]
    k_cache, v_cache, meta = _ragged_batch(seqs, 1, 8, 4, torch.float32)
    q = torch.randn(6, 1, 8, device=DEVICE)
    out = reference.paged_attention(q, k_cache, v_cache, meta, 1.0, sliding_window=2)
    keys = k_cache[meta.block_table[0].long()].reshape(-1, 8)[:6]
    values = v_cache[meta.block_table[0].long()].reshape(-1, 8)[:6]
    for i in range(6):
        lo = max(0, i - 1)
        weights = torch.softmax(q[i, 0] @ keys[lo : i + 1].T, dim=-1)
        torch.testing.assert_close(out[i, 0], weights @ values[lo : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_append(dtype: torch.dtype) -> None:
    k = _rand(9, 2, 16, dtype=dtype)
    v = _rand(9, 2, 16, dtype=dtype)
    k_cache = _rand(6, 4, 2, 16, dtype=dtype)
    v_cache = _rand(6, 4, 2, 16, dtype=dtype)
    slots = torch.randperm(24, device=DEVICE)[:9]
    slots[4] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.kv_append(k, v, k_ref, v_ref, slots)
    triton_ops.kv_append(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype: torch.dtype) -> None:
    x = _rand(7, 2 * (14336 if ON_GPU else 40), dtype=dtype) * 3
    torch.testing.assert_close(triton_ops.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x), **ULP_TOL[dtype])


# (tokens, experts, top-k, hidden, expert intermediate size)
MOE_CASES = (
    [(1, 8, 2, 4096, 1792), (37, 8, 2, 1024, 512), (300, 8, 2, 1024, 512), (64, 60, 4, 512, 256)]
    if ON_GPU
    else [(1, 4, 2, 32, 48), (7, 8, 2, 64, 32), (33, 4, 3, 16, 16), (5, 16, 4, 32, 40)]
)
MOE_TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def _moe_inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype):
    x = _rand(tokens, hidden, dtype=dtype)
    w13 = (_rand(experts, 2 * inter, hidden, dtype=torch.float32) * hidden**-0.5).to(dtype)
    w2 = (_rand(experts, hidden, inter, dtype=torch.float32) * inter**-0.5).to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, device=DEVICE), dim=-1), top_k)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MOE_CASES)
def test_fused_moe(dtype: torch.dtype, case) -> None:
    x, w13, w2, weights, ids = _moe_inputs(*case, dtype=dtype)
    out = triton_ops.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, reference.fused_moe(x, w13, w2, weights, ids), **MOE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (37, 8, 2), (70, 60, 4), (5, 128, 8)])
@pytest.mark.parametrize("normalize", [False, True])
def test_moe_route(dtype: torch.dtype, tokens: int, experts: int, top_k: int, normalize: bool) -> None:
    logits = _rand(tokens, experts, dtype=dtype) * 3
    weights, ids = triton_ops.moe_route(logits, top_k, normalize)
    want_weights, want_ids = reference.moe_route(logits, top_k, normalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)


def test_reference_fused_moe_is_the_per_token_sum() -> None:
    """The oracle itself: each token's output is its experts' SwiGLU outputs, weighted and summed."""
    x, w13, w2, weights, ids = _moe_inputs(9, 5, 2, 16, 24, dtype=torch.float32)
    out = reference.fused_moe(x, w13, w2, weights, ids)
    for t in range(9):
        want = torch.zeros(16, device=DEVICE)
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            want += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)


def test_align_by_expert_groups_slots() -> None:
    """Every slot appears once, in its expert's block-aligned group; padding rows carry T * k."""
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2]], device=DEVICE)
    layout = triton_moe.align_by_expert(ids, num_experts=5, block_m=4)
    slots = layout.sorted_slots.cpu()
    rows = int(layout.padded_rows.item())
    assert rows == 16  # experts 0, 1, 2, 3 hold 2, 1, 4, 1 slots, each padded to 4; expert 4 none
    real = slots[slots < 8]
    assert sorted(real.tolist()) == list(range(8))
    experts = ids.reshape(-1).cpu()
    for block in range(rows // 4):
        owner = int(layout.block_expert[block])
        group = slots[block * 4 : block * 4 + 4]
        assert all(int(experts[s]) == owner for s in group if s < 8)
    assert (slots[rows:] == 8).all()
