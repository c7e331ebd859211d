"""Every Triton op against its pure-PyTorch reference twin, on fresh random inputs.

On CUDA: bf16/fp16, Llama-like shapes, ragged mixes of prefill chunks and decode tokens. On the CPU:
Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py) at tiny shapes.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from mii_server.kernels import reference
from mii_server.kernels.metadata import AttentionMetadata

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from mii_server.kernels import fa4_attention, triton_attention, triton_ops

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# the interpreter runs numpy: fp32 and fp16 there (its bf16 arithmetic is unreliable); bf16 on the GPU
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
# tolerances for results rounded once more or less than the reference (one ulp of the dtype)
ULP_TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}
# attention: probabilities are rounded to the input dtype before the P @ V product
ATTN_TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [4096, 5120] if ON_GPU else [32, 48])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 13])  # one row: batch-1 decode, launched with more warps
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool, rows: int) -> None:
    x = _rand(rows, hidden, dtype=dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    residual = _rand(rows, hidden, dtype=dtype) if with_residual else None
    normed, stream = triton_ops.rms_norm(x, weight, 1e-6, residual)
    ref_normed, ref_stream = reference.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(stream, ref_stream, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref_normed, **ULP_TOL[dtype])
    if residual is None:
        assert stream is x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [14336, 1000] if ON_GPU else [24, 40])
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    x = _rand(7, 2 * inter, dtype=dtype) * 3
    torch.testing.assert_close(triton_ops.silu_and_mul(x), reference.silu_and_mul(x), **ULP_TOL[dtype])


def _cos_sin_cache(max_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, device=DEVICE).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, D]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (12, 4, 64)] if ON_GPU else [(4, 2, 16), (3, 1, 8)]
)
@pytest.mark.parametrize("rotary_share", [1, 2, 4])  # 1 / rotary_share of each head rotates (Phi: partial)
def test_rotary_kv_append(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, rotary_share: int
) -> None:
    tokens, num_blocks, block_size = 11, (64 if ON_GPU else 6), (16 if ON_GPU else 4)
    rotary_dim = head_dim // rotary_share
    cache = _cos_sin_cache(4096, rotary_dim)  # [P, R]: the first R of each head's D values rotate
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    # q, k and v as strided views into one fused projection, as a model produces them
    qkv = _rand(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = (
        part.view(tokens, -1, head_dim)
        for part in qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    )
    k_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[3] = -1  # a padding token: its q is rotated, nothing is written to the cache
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = reference.rotary_kv_append(q, k, v, positions, cache, k_ref, v_ref, slots)
    q_out = triton_ops.rotary_kv_append(q, k, v, positions, cache, k_cache, v_cache, slots)
    torch.testing.assert_close(q_out, q_ref, **ULP_TOL[dtype])
    torch.testing.assert_close(k_cache, k_ref, **ULP_TOL[dtype])  # every slot, the untouched ones too
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])  # the rest passes through
    assert torch.equal(v_cache, v_ref)


def _ragged_batch(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random blocked cache and the metadata of ``seqs`` = [(new tokens, context length)].

    Blocks are scattered at random and every cache slot holds random data, so a kernel that reads
    outside a sequence's context or the causal window gets a wrong answer.
    """
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = _rand(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    order = torch.randperm(num_blocks).tolist()
    width = max(1, max(blocks_per_seq))
    block_table = torch.zeros(len(seqs), width, dtype=torch.int32)
    positions, slots, cu, last = [], [], [0], []
    for s, ((q_len, ctx), n) in enumerate(zip(seqs, blocks_per_seq)):
        own = [order.pop() for _ in range(n)]
        block_table[s, :n] = torch.tensor(own, dtype=torch.int32)
        for p in range(ctx - q_len, ctx):
            positions.append(p)
            slots.append(own[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + q_len)
        last.append(cu[-1] - 1)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32, device=DEVICE),
        block_table=block_table.to(DEVICE),
        last_token_indices=torch.tensor(last, dtype=torch.int64, device=DEVICE),
        max_q_len=max(q for q, _ in seqs),
        max_context_len=max(ctx for _, ctx in seqs),
        num_decode_seqs=next((s for s, (q_len, _) in enumerate(seqs) if q_len != 1), len(seqs)),
    )
    return k_cache, v_cache, meta


# (q heads, kv heads, head dim, block size, [(new tokens, context)] per sequence)
if ON_GPU:
    MIXED_CASES = [
        (32, 8, 128, 16, [(1, 1000), (300, 300), (1, 17), (77, 250), (1, 2048), (0, 0), (5, 5)]),
        (32, 8, 64, 64, [(129, 700), (1, 64), (1, 65), (513, 513)]),
        (16, 16, 128, 32, [(1, 33), (64, 64), (200, 1111)]),
        (28, 4, 128, 128, [(1, 129), (40, 40), (1, 3000)]),
        (8, 1, 64, 16, [(250, 250)]),
    ]
    DECODE_CASES = [
        (32, 8, 128, 16, [(1, c) for c in (1, 15, 16, 17, 500, 2048, 4097, 33)]),
        (32, 8, 64, 64, [(1, c) for c in (1000, 3, 70)] + [(0, 0)]),
        (16, 2, 128, 32, [(1, 9000)]),
        (12, 12, 128, 16, [(1, c) for c in range(1, 300, 37)]),
    ]
else:
    MIXED_CASES = [
        (4, 2, 16, 4, [(1, 5), (7, 7), (3, 20), (0, 0), (1, 1)]),
        (4, 1, 32, 8, [(9, 30), (1, 17)]),
        (6, 2, 16, 16, [(18, 18), (2, 40)]),
        # four decode rows x 2 KV heads: the interpreter's 4 "SMs" filled, so split out (fills_gpu_unsplit)
        (4, 2, 16, 4, [(1, 9), (1, 30), (1, 2), (1, 13), (6, 6), (1, 7), (5, 21)]),
    ]
    DECODE_CASES = [
        (4, 2, 16, 4, [(1, 5), (1, 1), (0, 0), (1, 70)]),
        (3, 3, 32, 8, [(1, 8), (1, 9), (1, 33)]),
    ]


def _check_attention(
    dtype, num_q_heads, num_kv_heads, head_dim, block_size, seqs, attention, cache_dtype=None
) -> None:
    k_cache, v_cache, meta = _ragged_batch(seqs, num_kv_heads, head_dim, block_size, dtype)
    if cache_dtype is not None:  # e.g. kv_cache dtype fp8: the kernels widen what they read
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    q = _rand(sum(q for q, _ in seqs), num_q_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out = attention(q, k_cache, v_cache, meta, scale)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, expected, **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MIXED_CASES)
def test_paged_attention_mixed_batch(dtype, case) -> None:
    _check_attention(dtype, *case, triton_ops.paged_attention)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_paged_attention_decode(dtype, case) -> None:
    _check_attention(dtype, *case, triton_ops.paged_attention)


@pytest.mark.parametrize("case", [MIXED_CASES[0], DECODE_CASES[0]])
def test_paged_attention_reads_an_fp8_cache(case) -> None:
    _check_attention(DTYPES[0], *case, triton_ops.paged_attention, cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("case", [MIXED_CASES[0], DECODE_CASES[0]])
def test_bf16_queries_over_an_fp8_cache_beyond_fp16_range(case) -> None:
    """A bf16 q over an fp8 cache takes the fp16 products (``fp16_products``): rows whose elements
    pass fp16's range (2^16) are scaled down and back by a power of two, so they still match."""
    num_q_heads, num_kv_heads, head_dim, block_size, seqs = case
    k_cache, v_cache, meta = _ragged_batch(seqs, num_kv_heads, head_dim, block_size, torch.bfloat16)
    k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    q = _rand(sum(q for q, _ in seqs), num_q_heads, head_dim, dtype=torch.bfloat16)
    assert triton_attention.fp16_products(q, k_cache)
    q[::3] *= 2.0**17  # every third token's rows far past fp16's largest value
    q[1::3] *= 2.0**-10  # and others small, where fp16 is subnormal
    scale = 2.0**-17  # keeps the large rows' logits in a softmax that is not one-hot
    out = triton_ops.paged_attention(q, k_cache, v_cache, meta, scale)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **ATTN_TOL[torch.bfloat16])


@pytest.mark.parametrize("merge_in_kernel", [True, False])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_counts_agree(num_splits: int, merge_in_kernel: bool) -> None:
    """Every split count gives the reference's answer, including splits left without a tile, whether
    the last split merges them or a reduce launch does; twice, as the arrival counters reset."""
    dtype = DTYPES[0]
    seqs = [(1, c) for c in ((1, 40, 130, 2000) if ON_GPU else (1, 9, 30))]

    def attention(q, k_cache, v_cache, meta, scale):
        return triton_attention.paged_decode_attention(
            q, k_cache, v_cache, meta, scale, num_splits=num_splits, merge_in_kernel=merge_in_kernel
        )

    for _ in range(2):
        _check_attention(dtype, 8, 2, 64 if ON_GPU else 16, 16 if ON_GPU else 4, seqs, attention)
    if merge_in_kernel and num_splits > 1:
        assert not triton_attention.split_arrivals(DEVICE, 1).any()  # every launch left its counters at 0


def test_prefill_kernel_serves_decode_batches() -> None:
    """The ragged kernel alone (no decode dispatch) is right on a decode-only batch too."""
    dtype = DTYPES[0]
    seqs = [(1, c) for c in ((1, 70, 513) if ON_GPU else (1, 6, 21))]
    _check_attention(dtype, 4, 2, 64 if ON_GPU else 16, 16 if ON_GPU else 4, seqs,
                     triton_attention.paged_prefill_attention)  # fmt: skip


BULK_COPIES = not ON_GPU or torch.cuda.get_device_capability()[0] >= 9  # TMA: Hopper on, or the interpreter


@pytest.mark.parametrize("case", [c for c in MIXED_CASES if c[4][0][0] == 1])
def test_mixed_batch_sends_its_decode_rows_to_the_decode_kernel(case) -> None:
    """A mixed batch whose first sequences decode: both launches together give the reference's
    answer, and so does the ragged kernel alone on the same batch."""
    dtype = DTYPES[0]
    meta = _ragged_batch(case[4], case[1], case[2], case[3], dtype)[2]
    assert 1 <= meta.num_decode_seqs < len(case[4])
    _check_attention(dtype, *case, triton_attention.paged_mixed_attention)
    _check_attention(dtype, *case, triton_attention.paged_prefill_attention)


def test_trailing_prompts_attend_as_in_the_whole_batch() -> None:
    """The batch after its leading decode rows, counted from zero, gives those rows' answers."""
    dtype = DTYPES[0]
    case = MIXED_CASES[-1] if not ON_GPU else MIXED_CASES[0]
    q_heads, kv_heads, head_dim, block_size, seqs = case
    k_cache, v_cache, meta = _ragged_batch(seqs, kv_heads, head_dim, block_size, dtype)
    n = meta.num_decode_seqs
    assert n >= 1
    rest = meta.trailing_prompts
    assert rest.cu_q_lens.tolist() == [c - n for c in meta.cu_q_lens.tolist()[n:]]
    assert rest.num_seqs == len(seqs) - n and rest.num_decode_seqs == 0
    q = _rand(sum(q for q, _ in seqs), q_heads, head_dim, dtype=dtype)
    whole = reference.paged_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(reference.paged_attention(q[n:], k_cache, v_cache, rest, 0.2), whole[n:])


# prompt batches the dispatch hands to FlashAttention-4 (at least fa4_attention.MIN_PROMPT_TOKENS rows):
# fresh prompts, prompts after a cached prefix, decode rows mixed in, and decode rows enough to be split
# out to the decode kernel (fills_gpu_unsplit) with the prompts after them
FA4_CASES = [
    (32, 8, 128, 64, [(2048, 2048), (1500, 1500), (300, 1200), (9, 9)]),
    (32, 8, 128, 128, [(1, 500), (1100, 1100), (77, 3000)]),
    (32, 8, 128, 64, [(1, 64 + 37 * i) for i in range(40)] + [(1024, 1024), (200, 900)]),
    (16, 2, 64, 64, [(700, 1000), (700, 700)]),
]


@pytest.mark.skipif(not (ON_GPU and fa4_attention._is_hopper(DEVICE)), reason="FlashAttention-4 runs on Hopper here")
@pytest.mark.parametrize("case", FA4_CASES)
def test_prompt_rows_by_flash_attention_4(case) -> None:
    pytest.importorskip("flash_attn.cute", reason="the optional flash-attn-4 package")
    dtype = torch.bfloat16  # the only dtype it is given (fa4_attention.usable)
    q_heads, kv_heads, head_dim, block_size, seqs = case
    k_cache, v_cache, meta = _ragged_batch(seqs, kv_heads, head_dim, block_size, dtype)
    prompt_tokens = sum(q for q, _ in seqs[meta.num_decode_seqs :])
    q = _rand(prompt_tokens, q_heads, head_dim, dtype=dtype)
    assert fa4_attention.usable(q, k_cache, v_cache, prompt_tokens)  # so the dispatch below takes it
    _check_attention(dtype, *case, triton_ops.paged_attention)


def test_mixed_batches_split_once_their_decode_rows_fill_the_gpu() -> None:
    sms = triton_attention._num_sms(DEVICE)
    assert not triton_attention.fills_gpu_unsplit(0, 8, DEVICE)
    assert not triton_attention.fills_gpu_unsplit(-(-2 * sms // 8) - 1, 8, DEVICE)
    assert triton_attention.fills_gpu_unsplit(-(-2 * sms // 8), 8, DEVICE)
    if not ON_GPU:  # the case above that the dispatch sends down both kernels
        assert triton_attention.fills_gpu_unsplit(4, 2, DEVICE)


@pytest.mark.parametrize("tma", [False, True] if BULK_COPIES else [False])
def test_prefill_kernel_on_the_tail_of_a_batch(tma: bool) -> None:
    """The ragged kernel given the sequences after the first few (``first_seq``), with q and out views
    from their first token, as ``paged_mixed_attention`` calls it."""
    dtype = DTYPES[0]
    num_q_heads, num_kv_heads, head_dim, block_size, _ = MIXED_CASES[0]
    seqs = [(1, 40), (3, 70), (1, 5), (2 * block_size + 3, 3 * block_size), (0, 0), (block_size, block_size)]
    k_cache, v_cache, meta = _ragged_batch(seqs, num_kv_heads, head_dim, block_size, dtype)
    q = _rand(sum(n for n, _ in seqs), num_q_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    for first_seq in (1, 2, 3):
        row = sum(n for n, _ in seqs[:first_seq])
        out = torch.full_like(q, float("nan"))
        triton_attention.paged_prefill_attention(
            q[row:], k_cache, v_cache, meta, scale, tma=tma, block_n=min(block_size, 64 if ON_GPU else 16),
            first_seq=first_seq, out=out[row:],
        )  # fmt: skip
        torch.testing.assert_close(out[row:], expected[row:], **ATTN_TOL[dtype])
        assert out[:row].isnan().all()  # nothing written before the tail


@pytest.mark.skipif(not BULK_COPIES, reason="tensor descriptors need compute capability 9.0")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MIXED_CASES)
def test_prefill_kernel_with_bulk_copies(dtype, case) -> None:
    """The ragged kernel reading its K/V tiles through tensor descriptors (one tile per cache block)."""
    block_size = case[3]

    def attention(q, k_cache, v_cache, meta, scale):
        return triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, meta, scale, tma=True, block_n=min(block_size, 64 if ON_GPU else 16)
        )

    _check_attention(dtype, *case, attention)


def _poison_past_context(cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """NaN in every slot no sequence's context covers, as a never-written cache may hold."""
    block_size = cache.shape[1]
    used = torch.zeros(cache.shape[0] * block_size, dtype=torch.bool, device=cache.device)
    for s, ctx in enumerate(meta.context_lens.tolist()):
        pos = torch.arange(ctx, device=cache.device)
        used[meta.block_table[s, pos // block_size].long() * block_size + pos % block_size] = True
    cache.view(-1, *cache.shape[2:])[~used] = float("nan")


@pytest.mark.parametrize("tma", [False, True] if BULK_COPIES else [False])
def test_attention_ignores_nan_past_the_context(tma: bool) -> None:
    """Slots past a sequence's context (the tail of its last block, free blocks) never reach the output,
    through the ragged kernel on a mixed batch and the split-K kernel on a decode batch."""
    dtype = DTYPES[0]
    for case in (MIXED_CASES[0], DECODE_CASES[0]):
        num_q_heads, num_kv_heads, head_dim, block_size, seqs = case
        k_cache, v_cache, meta = _ragged_batch(seqs, num_kv_heads, head_dim, block_size, dtype)
        q = _rand(sum(n for n, _ in seqs), num_q_heads, head_dim, dtype=dtype)
        scale = head_dim**-0.5
        expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
        _poison_past_context(k_cache, meta)
        _poison_past_context(v_cache, meta)
        block_n = min(block_size, 64 if ON_GPU else 16)
        prefill = triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, meta, scale, tma=tma, block_n=block_n
        )
        torch.testing.assert_close(prefill, expected, **ATTN_TOL[dtype])
        dispatched = triton_ops.paged_attention(q, k_cache, v_cache, meta, scale)  # split-K when decode-only
        torch.testing.assert_close(dispatched, expected, **ATTN_TOL[dtype])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("seqs", [[(1, 300), (1, 17), (1, 1)], [(1, 300), (40, 90), (0, 0)]])
def test_paged_attention_replays_in_a_cuda_graph(seqs) -> None:
    """No host sync inside the op: it captures, and a replay follows new inputs in place."""
    dtype = torch.bfloat16
    k_cache, v_cache, meta = _ragged_batch(seqs, 8, 128, 16, dtype)
    q = _rand(sum(n for n, _ in seqs), 32, 128, dtype=dtype)
    triton_ops.paged_attention(q, k_cache, v_cache, meta, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_ops.paged_attention(q, k_cache, v_cache, meta, 0.1)
    q.copy_(_rand(*q.shape, dtype=dtype))
    v_cache.copy_(_rand(*v_cache.shape, dtype=dtype))
    graph.replay()
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.1)
    torch.testing.assert_close(out, expected, **ATTN_TOL[dtype])
