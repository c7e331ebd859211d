"""Micro-benchmarks of the Triton paged-attention kernels against the reference, on one CUDA device.

- decode: batch 64, context 2048 (``--decode-shape``), Llama-3-8B heads (32 q / 8 kv, D=128), bf16;
  achieved bytes/s (K+V read plus q and out) as a fraction of the HBM ceiling.
- ``--mixed``: steps of decode rows beside prompt chunks, the ragged kernel alone against the decode
  rows split out to the decode kernel (``paged_mixed_attention``; its prompt rows go to
  FlashAttention-4 where installed and usable, as ``prompts_by`` says).
- prefill: 8 sequences x 2048 new tokens (``--prefill-lengths``: any lengths; ``--prefill-cached``:
  tokens already cached before each), same heads; achieved causal TFLOP/s as a fraction of the dense
  bf16 matmul rate; beside it every library kernel for the same problem (FlashAttention-4 on the
  paged cache where installed, FlashAttention-2 varlen, cuDNN varlen, dense and per sequence, SDPA's
  backends), each checked first.
- ``--gemm``: the same linears at decode's few rows, cuBLAS against our Triton GEMMs on bf16 (where
  ``dense_linear`` takes them), int8 and fp8 weights (fp8 also through ``torch._scaled_mm``), each
  against its weight-read floor (``torch._scaled_mm`` also with fast accumulation, each with its
  largest error against a float64 product of the same fp8 operands); ``--sweep gemm`` times every
  tile shape of the Triton GEMMs instead of their defaults (from 17 rows, tiles as wide as the rows
  too). At one row, o_proj and down in fp8 also as the model runs them there: a 16-bit row quantized
  inside the one-row kernel (``gemm_{o_proj,down}_m1_fp8_quantize_x``), swept over the one-row tiles.
- ``--fused``: gate_up with its activation in one launch (``triton_fused_linear``) against cuBLAS then
  the activation kernel, and q/k/v with rotary and the KV append against cuBLAS then
  ``rotary_kv_append`` (and with fp8 weights, against the fp8 GEMM then ``rotary_kv_append``);
  ``--sweep fused`` also times every tile shape of the fused kernels.
- ``--logits``: the LM head writing float32 logits in one launch (``triton_quant.logits_linear``)
  against cuBLAS then the float cast; ``--sweep logits`` also times every tile shape. Then the head's
  int8 copy (``quantization.lm_head``) against the 16-bit head, at the same rows.
- ``--argmax``: the sampler's greedy argmax over a 128,256-entry vocabulary at 1-256 rows, torch's
  against ours (``triton_argmax``), each checked against the other first.
- ``--act-fp8``: fp8's SiLU·mul quantizer (``silu_and_mul_fp8``, one launch) at 1-8,192 rows of
  Llama-3-8B's and Llama-3-70B's MLP widths, against ``silu_and_mul`` then
  ``quantize_fp8_per_token``, each checked against the other first; ``do_bench`` medians over 4
  input copies in turn, and the floor of reading the row and writing it once.
- ``--blas``: Llama-3-8B's linear layers at 1, 256 and 8192 rows through cuBLAS and cuBLASLt, against
  the larger of their weight-read and compute floors.

Run from the repository root with the package importable, e.g.
``PYTHONPATH=<dir holding mii_server> python3 bench/kernels_bench.py [--sweep]``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from mii_server.kernels import (
    fa4_attention,
    reference,
    triton_argmax,
    triton_attention,
    triton_fp8,
    triton_fused_linear,
    triton_one_row,
    triton_pointwise,
    triton_quant,
)
from mii_server.kernels.metadata import AttentionMetadata
from mii_server.kernels.reference_quant import Fp8Rows
from mii_server.quantization.lm_head import INT8_HEAD_MAX_ROWS
from mii_server.quantization.quantize import quantize_int8

HBM_BYTES_PER_S = 4.24e12  # measured device-to-device copy rate on the H200
BF16_FLOPS = 790e12  # measured dense bf16 matmul rate on the H200


def make_batch(
    seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: str = "cuda",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:  # fmt: skip
    """q, k_cache, v_cache and metadata for seqs = [(new tokens, context)], blocks scattered at random."""
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    width = max(blocks_per_seq)
    block_table = torch.zeros(len(seqs), width, dtype=torch.int32, device=device)
    cu, start = [0], 0
    for s, n in enumerate(blocks_per_seq):
        block_table[s, :n] = order[start : start + n]
        start += n
        cu.append(cu[-1] + seqs[s][0])
    positions = torch.cat([torch.arange(c - q, c) for q, c in seqs]).to(device)
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=torch.zeros_like(positions),  # unused by attention
        cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=device),
        block_table=block_table,
        last_token_indices=torch.tensor(cu[1:], device=device) - 1,
        max_q_len=max(q for q, _ in seqs),
        max_context_len=max(c for _, c in seqs),
    )
    q = torch.randn(cu[-1], num_q_heads, head_dim, device=device, dtype=dtype)
    return q, k_cache, v_cache, meta


def _report(name: str, ms: float, **fields: float | str) -> dict:
    row = {"bench": name, "ms": round(ms, 4), **{k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()}}
    print(json.dumps(row), flush=True)
    return row


def time_against_reference(
    q, k_cache, v_cache, meta, scale, kernel=triton_attention.paged_attention
) -> tuple[float, float]:
    """(reference ms, Triton ms) of paged attention on one batch, after checking they agree."""
    ref_ms = do_bench(lambda: reference.paged_attention(q, k_cache, v_cache, meta, scale), rep=200)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(kernel(q, k_cache, v_cache, meta, scale), expected, atol=2e-2, rtol=2e-2)
    ms = do_bench(lambda: kernel(q, k_cache, v_cache, meta, scale), rep=300)
    return ref_ms, ms


def bench_decode(sweep: bool, block_size: int, batch: int, ctx: int, kv_dtype: str = "bf16") -> list[dict]:
    """``kv_dtype`` "fp8": the cache holds fp8 e4m3 keys and values (``kv_cache={"dtype": "fp8"}``)."""
    hq, hk, d = 32, 8, 128
    q, k_cache, v_cache, meta = make_batch([(1, ctx)] * batch, hq, hk, d, block_size, torch.bfloat16)
    if kv_dtype == "fp8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    scale = d**-0.5
    moved = 2 * batch * ctx * hk * d * k_cache.element_size() + 2 * q.numel() * 2  # K+V read, q read, out written
    rows = []
    ref_ms, ms = time_against_reference(q, k_cache, v_cache, meta, scale)
    gbs = moved / ms / 1e-3
    rows.append(_report(
        f"decode_b{batch}_ctx{ctx}_bs{block_size}_{kv_dtype}", ms, TBps=gbs / 1e12, frac_hbm=gbs / HBM_BYTES_PER_S,
        reference_ms=ref_ms, speedup_vs_reference=ref_ms / ms,
    ))  # fmt: skip
    if sweep:
        for splits in (1, 2, 4, 8):
            for block_n in (32, 64, 128):
                for warps, stages in ((4, 2), (4, 3), (8, 3)):

                    def run(splits=splits, block_n=block_n, warps=warps, stages=stages):
                        return triton_attention.paged_decode_attention(
                            q, k_cache, v_cache, meta, scale, num_splits=splits, block_n=block_n,
                            num_warps=warps, num_stages=stages,
                        )  # fmt: skip

                    try:
                        run()
                        ms = do_bench(run, rep=60)
                    except Exception as exc:  # noqa: BLE001 - a config may not fit; report and go on
                        print(json.dumps({"bench": "decode_sweep", "error": str(exc)[:120]}))
                        continue
                    gbs = moved / ms / 1e-3
                    rows.append(_report(
                        f"decode_sweep_{kv_dtype}", ms, splits=splits, block_n=block_n, warps=warps, stages=stages,
                        frac_hbm=gbs / HBM_BYTES_PER_S,
                    ))  # fmt: skip
    return rows


def bench_prefill(sweep: bool, block_size: int, lengths: list[int], cached: int = 0) -> list[dict]:
    hq, hk, d = 32, 8, 128
    seqs = [(n, cached + n) for n in lengths]
    q, k_cache, v_cache, meta = make_batch(seqs, hq, hk, d, block_size, torch.bfloat16)
    scale = d**-0.5
    # QK^T and PV: each new token attends to the cached prefix and, causally, to the new tokens before it
    flops = sum(4 * hq * d * (n * cached + n * (n + 1) / 2) for n in lengths)
    rows = []
    # the Triton kernel itself: the dispatch would hand this batch to FlashAttention-4 where installed
    ref_ms, ms = time_against_reference(q, k_cache, v_cache, meta, scale, triton_attention.paged_prefill_attention)
    tf = flops / ms / 1e-3
    label = f"{len(lengths)}x{lengths[0]}" if len(set(lengths)) == 1 else f"{len(lengths)}_seqs_{sum(lengths)}_tokens"
    label += f"_after{cached}" if cached else ""
    rows.append(_report(
        f"prefill_{label}_bs{block_size}", ms, TFLOPs=tf / 1e12, frac_bf16=tf / BF16_FLOPS,
        reference_ms=ref_ms, speedup_vs_reference=ref_ms / ms,
    ))  # fmt: skip
    rows += bench_prefill_library(q, k_cache, v_cache, meta, scale, flops)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    if sweep:
        configs = [  # (block_m, block_n, warps, stages, K/V tiles by bulk copy)
            (128, 32, 4, 3, False), (128, 128, 8, 3, False), (128, 64, 4, 3, False),
            (128, 32, 4, 3, True), (128, 64, 4, 3, True), (128, 64, 4, 4, True), (128, 64, 4, 2, True),
            (128, 64, 8, 3, True), (256, 64, 8, 3, True), (256, 64, 8, 2, True), (256, 32, 8, 3, True),
            (64, 64, 4, 3, True), (128, 128, 8, 3, True), (256, 128, 8, 2, True),
        ]  # fmt: skip
        for block_m, block_n, warps, stages, tma in configs:
            if tma and not triton_attention.tma_supported(k_cache, v_cache, block_n):
                continue

            def run(block_m=block_m, block_n=block_n, warps=warps, stages=stages, tma=tma):
                return triton_attention.paged_prefill_attention(
                    q, k_cache, v_cache, meta, scale, block_m=block_m, block_n=block_n,
                    num_warps=warps, num_stages=stages, tma=tma,
                )  # fmt: skip

            try:
                torch.testing.assert_close(run(), expected, atol=2e-2, rtol=2e-2)
                ms = do_bench(run, rep=100)
            except Exception as exc:  # noqa: BLE001 - a config may not fit; report and go on
                print(json.dumps({"bench": "prefill_sweep", "error": str(exc)[:120]}))
                continue
            rows.append(_report(
                "prefill_sweep", ms, block_m=block_m, block_n=block_n, warps=warps, stages=stages, tma=tma,
                frac_bf16=flops / ms / 1e-3 / BF16_FLOPS,
            ))  # fmt: skip
    return rows


# (decode rows, prompt tokens beside them): steps as the variable workload's SplitFuse schedule makes
# them at an 8,192-token budget, from the first decodes among full prefill chunks to many decodes
# beside a small chunk
MIXED_STEPS = [(1, 8191), (4, 8188), (16, 8176), (64, 8128), (256, 7936), (256, 512), (512, 512), (128, 64)]


def bench_mixed(block_size: int, steps: list[tuple[int, int]] = MIXED_STEPS) -> list[dict]:
    """Mixed steps: decode rows (contexts uniform in [64, 2560]) first, then fresh prompts of up to
    2,048 tokens; the ragged kernel alone against the decode rows in the decode kernel and the rest in
    the ragged kernel (``paged_mixed_attention``), each checked against the reference first."""
    hq, hk, d = 32, 8, 128
    rng = torch.Generator().manual_seed(0)
    rows = []
    for decodes, prompt_tokens in steps:
        contexts = torch.randint(64, 2561, (decodes,), generator=rng).tolist()
        prompts = [2048] * (prompt_tokens // 2048) + ([prompt_tokens % 2048] if prompt_tokens % 2048 else [])
        seqs = [(1, c) for c in contexts] + [(n, n) for n in prompts]
        q, k_cache, v_cache, meta = make_batch(seqs, hq, hk, d, block_size, torch.bfloat16)
        meta.num_decode_seqs = decodes
        scale = d**-0.5
        expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
        timed = {}
        for name, fn in (("ragged_only", triton_attention.paged_prefill_attention),
                         ("decode_split", triton_attention.paged_mixed_attention)):  # fmt: skip
            run = functools.partial(fn, q, k_cache, v_cache, meta, scale)
            torch.testing.assert_close(run(), expected, atol=2e-2, rtol=2e-2)
            timed[name] = do_bench(run, rep=200)
        decode_bytes = 2 * sum(contexts) * hk * d * 2  # K + V of the decode rows' contexts
        prompts_by = "fa4" if fa4_attention.usable(q, k_cache, v_cache, prompt_tokens) else "triton"
        rows.append(_report(
            f"mixed_{decodes}dec_{prompt_tokens}tok_bs{block_size}", timed["decode_split"],
            ragged_only_ms=timed["ragged_only"], speedup=timed["ragged_only"] / timed["decode_split"],
            decode_kv_floor_ms=decode_bytes / HBM_BYTES_PER_S * 1e3, prompts_by=prompts_by,
        ))  # fmt: skip
    return rows


def context_slots(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """int64 [sum of contexts]: the cache slot of every context position of every sequence, in order."""
    rows = []
    for s, ctx in enumerate(meta.context_lens.tolist()):
        pos = torch.arange(ctx, device=meta.block_table.device)
        rows.append(meta.block_table[s, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(rows)


def bench_prefill_library(q, k_cache, v_cache, meta, scale, flops) -> list[dict]:
    """The library alternatives for prefill attention (issue 16), each checked against the reference
    and timed on K/V gathered from the paged cache into contiguous tensors (gather not timed):

    - ``fa2_varlen``: FlashAttention-2 varlen, ``aten._flash_attention_forward`` (GQA native);
    - ``cudnn_varlen`` / ``cudnn_varlen_mha``: cuDNN's fused attention, varlen through
      ``aten._cudnn_attention_forward`` (``cum_seq_*``), with GQA heads and with K/V repeated to all
      query heads;
    - ``sdpa_<backend>``: ``F.scaled_dot_product_attention`` on padded [S, H, L, D] tensors with one
      backend forced (cuDNN, flash, memory-efficient), GQA through ``enable_gqa``; only where every
      sequence has the same length, so the ragged batch is that layout without a copy;
    - ``sdpa_cudnn_per_sequence``: what a dispatch of ragged fresh prompts to cuDNN would run: one
      SDPA call per sequence on [1, H, L, D] views of the ragged tensors, each output copied into
      place;
    - ``fa4_*``: FlashAttention-4's CuTe kernels (the ``flash-attn-4`` package, Hopper's kernel on an
      H200) read straight from the paged cache, where installed (see ``fa4_candidates``).

    Each row also gives ``host_us``: the caller's time per call, launches included, without waiting
    for the device.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    block_size, hk, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    hq = q.shape[1]
    slots = context_slots(meta, block_size)
    cu_k = torch.zeros_like(meta.cu_q_lens)
    cu_k[1:] = meta.context_lens.cumsum(0)
    k = k_cache.view(-1, hk, d).index_select(0, slots)
    v = v_cache.view(-1, hk, d).index_select(0, slots)
    k_mha, v_mha = (t.repeat_interleave(hq // hk, dim=1) for t in (k, v))
    max_q, max_k = meta.max_q_len, meta.max_context_len
    nseq, length = meta.num_seqs, max_q  # the padded layout assumes equal fresh sequences

    def padded(t: torch.Tensor) -> torch.Tensor:
        return t.view(nseq, length, t.shape[1], d).transpose(1, 2)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, scale=scale,
                                                     enable_gqa=True)  # fmt: skip
            return out.transpose(1, 2).reshape(q.shape)

        return run

    cu = meta.cu_q_lens.tolist()

    def cudnn_per_sequence():
        out = torch.empty_like(q)
        for a, b in itertools.pairwise(cu):
            qs, ks, vs = (t[a:b].unsqueeze(0).transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            out[a:b].copy_(o[0].transpose(0, 1))
        return out

    candidates = {
        "sdpa_cudnn_per_sequence": cudnn_per_sequence,
        "fa2_varlen": lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, meta.cu_q_lens, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0],
        "cudnn_varlen": lambda: torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, meta.cu_q_lens, cu_k, max_q, max_k, False, 0.0, True, scale=scale)[0],
        "cudnn_varlen_mha": lambda: torch.ops.aten._cudnn_attention_forward(
            q, k_mha, v_mha, None, meta.cu_q_lens, cu_k, max_q, max_k, False, 0.0, True, scale=scale)[0],
    }  # fmt: skip
    candidates.update(fa4_candidates(q, k_cache, v_cache, meta, scale))
    if meta.context_lens.eq(length).all() and q.shape[0] == nseq * length:
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip
            candidates[f"sdpa_{name}"] = sdpa(backend)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    rows = []
    for name, run in candidates.items():
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            first = run()  # a library's first call at new shapes also builds its plans (cuDNN graphs)
            torch.cuda.synchronize()
            first_ms = (time.perf_counter() - start) * 1e3
            torch.testing.assert_close(first, expected, atol=2e-2, rtol=2e-2)
            ms = do_bench(run, rep=200)
        except Exception as exc:  # noqa: BLE001 - a backend may be missing or refuse the shape
            print(json.dumps({"bench": f"prefill_{name}", "error": str(exc)[:200]}))
            continue
        rate = flops / ms / 1e-3
        rows.append(_report(f"prefill_{name}", ms, TFLOPs=rate / 1e12, frac_bf16=rate / BF16_FLOPS,
                            first_call_ms=first_ms, host_us=_host_us(run)))  # fmt: skip
    return rows


def _host_us(run, calls: int = 10) -> float:
    """Mean time a call takes on the host, the device left to run behind it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def fa4_candidates(q, k_cache, v_cache, meta, scale) -> dict:
    """FlashAttention-4 (``flash_attn.cute``) on the paged cache as it is: the batch's cumulative query
    lengths, the contexts as ``seqused_k`` and the block table as its page table.

    - ``fa4_paged``: the public ``flash_attn_varlen_func`` with its own tiles (128 x 128 at D = 128
      on Hopper; a cache block of another size makes it gather K/V by cp.async instead of TMA);
    - ``fa4_as_dispatched``: what ``paged_attention`` runs (``fa4_attention.paged_prefill_attention``:
      at blocks of 64, 64-key tiles, so that each tile is one TMA copy).
    """
    fa4 = fa4_attention.library()
    if fa4 is None:
        print(json.dumps({"bench": "prefill_fa4", "error": "flash-attn-4 not importable (or turned off)"}))
        return {}
    paged = {
        "cu_seqlens_q": meta.cu_q_lens, "seqused_k": meta.context_lens, "max_seqlen_q": meta.max_q_len,
        "max_seqlen_k": meta.max_context_len, "page_table": meta.block_table, "softmax_scale": scale,
        "causal": True,
    }  # fmt: skip
    return {
        "fa4_paged": lambda: fa4.flash_attn_varlen_func(q, k_cache, v_cache, **paged)[0],
        "fa4_as_dispatched": lambda: fa4_attention.paged_prefill_attention(q, k_cache, v_cache, meta, scale),
    }


# Llama-3-8B's linear layers, (N, K): qkv, o_proj, gate_up, down, LM head
LINEAR_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
                 "down": (4096, 14336), "lm_head": (128256, 4096)}  # fmt: skip


def bench_blas_libraries(rows_list: tuple[int, ...] = (1, 256, 8192)) -> list[dict]:
    """F.linear through cuBLAS (torch's default) and cuBLASLt on the model's weight shapes, replayed
    in a CUDA graph over 8 distinct weights of each shape (so L2 holds none of them, as in a forward
    over 32 layers). Reports microseconds per product and the ratio default / cuBLASLt."""
    out = []
    default = torch.backends.cuda.preferred_blas_library()
    for name, (n, k) in LINEAR_SHAPES.items():
        copies = 2 if name == "lm_head" else 8
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                fn = lambda x=x, ws=weights: [F.linear(x, w) for w in ws]
                times[lib] = triton.testing.do_bench_cudagraph(fn, rep=100) / copies
            torch.backends.cuda.preferred_blas_library(default)
            floor_ms = max(n * k * 2 / HBM_BYTES_PER_S, 2 * m * n * k / BF16_FLOPS) * 1e3
            out.append(_report(f"blas_{name}_m{m}", times["cublas"], cublaslt_ms=times["cublaslt"],
                               cublas_over_cublaslt=times["cublas"] / times["cublaslt"], floor_ms=floor_ms,
                               cublas_frac_floor=floor_ms / times["cublas"]))  # fmt: skip
        del weights
    return out


# one row: triton_one_row's loop (BLOCK_M 1: weight rows per program, K step, warps; no stages)
ONE_ROW_TILES = [(1, bn, bk, warps, 1) for bn in (4, 8, 16, 32) for bk in (512, 1024, 2048) for warps in (4, 8)]


def _gemm_tiles(fp8: bool, rows: int) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried at few rows; fp8 reads half the bytes per K.
    One row also tries ``triton_one_row``'s tiles (BLOCK_M 1: weight rows per program, K step, warps;
    no stages)."""
    ks = (256, 512, 1024) if fp8 else (128, 256, 512)
    tiles = [(16, bn, bk, 4, s) for bn in (16, 32, 64) for bk in ks for s in (3, 5)]
    tiles += [(16, 32, ks[1], 8, 4), (16, 64, ks[1], 8, 3), (16, 128, ks[0], 8, 3)]
    if rows == 1:
        tiles += ONE_ROW_TILES
    if rows > 16:  # 17-32 rows as one 32-row slice (as main takes them), then compute-bound
        tiles += [(32, bn, bk, 4, s) for bn in (16, 32, 64) for bk in ks[:2] for s in (3, 4)]
        tiles += [(bm, bn, 128 if fp8 else 64, w, s) for bm in (64, 128) for bn in (64, 128, 256)
                  for w, s in ((4, 3), (4, 4), (8, 3), (8, 4))]  # fmt: skip
    return tiles


def _graph_us(fn, copies: int) -> float:
    """Microseconds per product of ``fn``, which runs ``copies`` of them, replayed in a CUDA graph."""
    return triton.testing.do_bench_cudagraph(fn, rep=50) / copies * 1e3


def _sweep_gemm(
    label: str, run, weights: list[torch.Tensor], floor_us: float, fp8: bool, sweep: bool, m: int,
    candidates: list[tuple[int, int, int, int, int]] | None = None,
) -> list[dict]:  # fmt: skip
    """Time ``run(weight, tiles)`` at ``m`` rows with the default tiles and (``sweep``) every other
    configuration (``candidates``, else ``_gemm_tiles``'), each checked against the default's output."""
    expected = run(weights[0], None)
    rows = []
    for tiles in [None, *((candidates or _gemm_tiles(fp8, m)) if sweep else [])]:
        try:
            torch.testing.assert_close(run(weights[0], tiles), expected, atol=1e-2, rtol=1e-2)
            us = _graph_us(lambda tiles=tiles: [run(w, tiles) for w in weights], len(weights))
        except Exception as exc:  # noqa: BLE001 - a tile may not fit in shared memory
            print(json.dumps({"bench": label, "tiles": tiles, "error": str(exc)[:100]}))
            continue
        rows.append({"bench": label, "ms": round(us / 1e3, 4), "us": round(us, 2),
                     "frac_floor": round(floor_us / us, 4), "tiles": tiles or "default"})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    best = min(rows, key=lambda r: r["us"])
    print(json.dumps({"bench": f"{label}_best", "tiles": best["tiles"], "us": best["us"],
                      "frac_floor": best["frac_floor"]}))  # fmt: skip
    return rows


def bench_decode_gemms(rows_list: tuple[int, ...], sweep: bool) -> list[dict]:
    """The model's linears at decode's few rows: cuBLAS on bf16 weights against our Triton GEMMs on
    bf16 (``dense_linear``, where it takes the product; the weight-only kernel on a bf16 weight when
    sweeping), int8 (weight-only) and fp8 (activations quantized per token; the Triton GEMM and
    ``torch._scaled_mm``) weights; ``sweep``: over every tile configuration.
    CUDA-graph replay over 8 copies of each weight (so L2 holds none); microseconds per product and the
    fraction of the weight-read floor."""
    out = []
    for name, (n, k) in LINEAR_SHAPES.items():
        if name == "lm_head":
            continue
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(8)]
        weights = {
            "bf16": bf16,
            "int8": [torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8) for _ in range(8)],
            "fp8": [w.mul(64).to(torch.float8_e4m3fn) for w in bf16],
        }
        scale = torch.rand(n, 1, device="cuda") / 64 + 1e-3
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, x_scale = triton_fp8.quantize_fp8_per_token(x)
            floor_us = n * k * 2 / HBM_BYTES_PER_S * 1e6
            cublas_us = _graph_us(functools.partial(lambda x, ws: [F.linear(x, w) for w in ws], x, bf16), 8)
            out.append(_report(f"gemm_{name}_m{m}_cublas_bf16", cublas_us / 1e3, us=cublas_us,
                               frac_floor=floor_us / cublas_us))  # fmt: skip
            bf16_run = functools.partial(_weight_only, x, scale) if sweep else functools.partial(_dense, x)
            out += _sweep_gemm(f"gemm_{name}_m{m}_bf16", bf16_run, bf16, floor_us, False, sweep, m)
            out += _sweep_gemm(
                f"gemm_{name}_m{m}_int8", functools.partial(_weight_only, x, scale), weights["int8"],
                floor_us / 2, False, sweep, m,
            )  # fmt: skip
            out += _sweep_gemm(
                f"gemm_{name}_m{m}_fp8", functools.partial(_fp8, q, x_scale, scale), weights["fp8"],
                floor_us / 2, True, sweep, m,
            )  # fmt: skip
            # why: the sweep above gives x already quantized (as the norm hands qkv and gate_up); the
            # model's o_proj and down get one 16-bit row and quantize it in the kernel
            if m == 1 and name in ("o_proj", "down"):
                out += _sweep_gemm(
                    f"gemm_{name}_m1_fp8_quantize_x", functools.partial(_fp8_quantize_x, x, scale),
                    weights["fp8"], floor_us / 2, True, sweep, m, ONE_ROW_TILES,
                )  # fmt: skip
            w0 = weights["fp8"][0]
            exact = (q.double() * x_scale.double()[:, None]) @ (w0.double() * scale.double()).t()
            for fast in (False, True):  # False: fp8_gemm_scaled_mm's mode; True: vLLM's CUTLASS kernels'
                run = functools.partial(triton_fp8.fp8_gemm_scaled_mm, q, x_scale, scale=scale, bias=None,
                                        out_dtype=torch.bfloat16, fast_accum=fast)  # fmt: skip
                us = _each_weight_us(run, weights["fp8"])
                error = ((run(w0).double() - exact).abs().max() / exact.abs().max()).item()
                out.append(_report(
                    f"gemm_{name}_m{m}_fp8_scaled_mm" + ("_fast_accum" if fast else ""), us / 1e3, us=us,
                    frac_floor=floor_us / 2 / us, max_relative_error=error,
                ))  # fmt: skip
    return out


GATED_TILES = [(16, bn, bk, 4, stages) for bn in (16, 32, 64) for bk in (128, 256, 512) for stages in (3, 4)]
QKV_ROTARY_TILES = [
    (16, bn, bk, warps, stages)
    for bn in (16, 32, 64)
    for bk in (128, 256, 512)
    for warps, stages in ((4, 3), (4, 4), (4, 5), (8, 3))
]
FP8_QKV_ROTARY_TILES = [
    (16, bn, bk, 4, stages) for bn in (16, 32, 64) for bk in (256, 512, 1024) for stages in (2, 3, 4)
]
# one row of a fused pair: BLOCK_N rows of each of the two row ranges paired
ONE_ROW_PAIR_TILES = [t for t in ONE_ROW_TILES if t[1] <= 16]


def _each_weight_us(fn, weights: list[torch.Tensor]) -> float:
    """Microseconds per call of ``fn(weight)``, over ``weights`` replayed in a CUDA graph."""
    return _graph_us(functools.partial(lambda fn, ws: [fn(w) for w in ws], fn, weights), len(weights))


def _gated_unfused(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return triton_pointwise.silu_and_mul(F.linear(x, weight))


def _sweep_fused(
    name: str, m: int, n_k: tuple[int, int], unfused, fused, tiles_list: list,
    weight_dtype: torch.dtype = torch.bfloat16,
) -> dict:  # fmt: skip
    """``fused(x, weight, tiles)`` with its default tiles and each of ``tiles_list`` (at one row, the
    one-row loop's too) against ``unfused(x, weight)`` (each checked against it first), CUDA-graph
    replay over 8 weight copies."""
    n, k = n_k
    if tiles_list and m == 1:
        tiles_list = [*tiles_list, *ONE_ROW_PAIR_TILES]
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).to(weight_dtype) for _ in range(8)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    unfused_us = _each_weight_us(functools.partial(unfused, x), weights)
    expected = unfused(x, weights[0])
    best = None
    for tiles in [None, *tiles_list]:
        run = functools.partial(fused, x, tiles=tiles)
        label = str(tiles or "default")
        try:
            torch.testing.assert_close(run(weights[0]), expected, atol=2e-2, rtol=2e-2)
            us = _each_weight_us(run, weights)
        except Exception as exc:  # noqa: BLE001 - a tile may not fit in shared memory
            print(json.dumps({"bench": f"{name}_m{m}", "tiles": label, "error": str(exc)[:100]}))
            continue
        print(json.dumps({"bench": f"{name}_m{m}", "tiles": label, "us": round(us, 2)}), flush=True)
        best = min(best or (us, label), (us, label))
    print(json.dumps({"bench": f"{name}_m{m}_best_tiles", "tiles": best[1]}))
    return _report(f"{name}_m{m}", best[0] / 1e3, unfused_us=unfused_us, fused_us=best[0],
                   floor_us=n * k * 2 / HBM_BYTES_PER_S * 1e6, saved_us=unfused_us - best[0])  # fmt: skip


def bench_fused_gate_up(rows_list: tuple[int, ...], sweep: bool) -> list[dict]:
    """Llama-3-8B's gate_up with its SiLU-and-mul: the fused launch against the two launches it
    replaces (cuBLAS, then the activation kernel), microseconds per pair and the weight-read floor;
    ``sweep``: every tile shape of the gated GEMM."""
    def fused(x, weight, tiles):
        return triton_fused_linear.linear_act_and_mul(x, weight, gelu_tanh=False, tiles=tiles)

    tiles = GATED_TILES if sweep else []
    return [_sweep_fused("fused_gate_up_act", m, LINEAR_SHAPES["gate_up"], _gated_unfused, fused, tiles)
            for m in rows_list]  # fmt: skip


def bench_fused_qkv_rotary(rows_list: tuple[int, ...], sweep: bool, fp8: bool = False) -> list[dict]:
    """Llama-3-8B's q/k/v with rotary and the KV append (32 / 8 heads of 128, one token a row, cache
    slots spread over 64 blocks of 64): the fused launch against cuBLAS then ``rotary_kv_append``;
    ``sweep``: every tile shape of the fused kernel (BLOCK_N: columns of each half of a head).
    ``fp8``: fp8 weights and rows quantized per token (as the norm hands them over), the fused launch
    against the fp8 GEMM then ``rotary_kv_append``."""
    hk, d = 8, 128  # and 32 query heads: LINEAR_SHAPES["qkv"]
    n, k = LINEAR_SHAPES["qkv"]
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.outer(torch.arange(8192, device="cuda").float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    k_cache, v_cache = (torch.zeros(64, 64, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = torch.rand(n, 1, device="cuda") / 64 + 1e-3
    out = []
    for m in rows_list:
        positions = torch.randint(0, 8192, (m,), device="cuda")
        slots = torch.randperm(64 * 64, device="cuda")[:m]
        rest = (positions, cos_sin, k_cache, v_cache, slots)
        rows8 = None
        if fp8:  # quantized once, outside the timed calls, as the norm hands them over
            rows8 = Fp8Rows(*triton_fp8.quantize_fp8_per_token(torch.randn(m, k, device="cuda")), torch.bfloat16)

        def unfused(x, weight, rest=rest, rows8=rows8):
            qkv = triton_fp8.fp8_linear(rows8, weight, scale) if fp8 else F.linear(x, weight)
            return triton_pointwise.rotary_kv_append(*reference.split_qkv(qkv, hk, d), *rest)

        def fused(x, weight, tiles, rest=rest, rows8=rows8):
            if fp8:
                return triton_fused_linear.fp8_linear_rotary_kv_append(rows8, weight, scale, None, *rest, tiles=tiles)
            return triton_fused_linear.linear_rotary_kv_append(x, weight, None, *rest, tiles=tiles)

        tiles = (FP8_QKV_ROTARY_TILES if fp8 else QKV_ROTARY_TILES) if sweep else []
        name = "fp8_fused_qkv_rotary" if fp8 else "fused_qkv_rotary"
        weight_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        out.append(_sweep_fused(name, m, (n, k), unfused, fused, tiles, weight_dtype))
    return out


LOGITS_TILES = [
    (16, bn, bk, 4, stages) for bn in (32, 64, 128, 256) for bk in (64, 128, 256) for stages in (2, 3, 4)
] + [(16, 64, 256, 8, 3), (16, 128, 128, 8, 4)]


def bench_logits(rows_list: tuple[int, ...], sweep: bool) -> list[dict]:
    """Llama-3-8B's LM head to float32 logits: ``triton_quant.logits_linear`` against cuBLAS then the
    float cast (``reference.logits_linear``), microseconds per head; ``sweep``: every tile shape."""
    tiles = LOGITS_TILES if sweep else []
    head = LINEAR_SHAPES["lm_head"]
    return [_sweep_fused("logits", m, head, reference.logits_linear, triton_quant.logits_linear, tiles)
            for m in rows_list]  # fmt: skip


def bench_int8_logits(rows_list: tuple[int, ...]) -> list[dict]:
    """Llama-3-8B's LM head and its int8 copy (``quantization.lm_head``), both through
    ``triton_quant.logits_linear``, microseconds per head (CUDA-graph replay over 2 copies), each
    checked first against the reference; the copy is read at up to ``INT8_HEAD_MAX_ROWS`` rows."""
    n, k = LINEAR_SHAPES["lm_head"]
    heads = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(2)]
    copies = [quantize_int8(head.float(), 0, k) for head in heads]
    out = []
    for m in rows_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        codes, scale = copies[0]
        torch.testing.assert_close(
            triton_quant.logits_linear(x, codes, scale), reference.logits_linear(x, codes, scale), atol=2e-2, rtol=2e-2
        )  # fmt: skip
        bf16_us = _graph_us(lambda x=x: [triton_quant.logits_linear(x, head) for head in heads], len(heads))
        int8_us = _graph_us(lambda x=x: [triton_quant.logits_linear(x, c, s) for c, s in copies], len(copies))
        out.append(_report(f"logits_int8_m{m}", int8_us / 1e3, bf16_us=bf16_us, int8_us=int8_us,
                           floor_us=n * k / HBM_BYTES_PER_S * 1e6, read_by_model=m <= INT8_HEAD_MAX_ROWS))  # fmt: skip
    return out


def bench_argmax(vocab: int = 128256) -> list[dict]:
    """torch's row-wise argmax against ``triton_argmax.argmax_rows`` on float32 logits: launched as the
    sampler launches them (``do_bench``) and on the device alone (replayed in a CUDA graph)."""
    out = []
    for rows in (1, 2, 4, 8, 16, 64, 256):
        logits = torch.randn(rows, vocab, device="cuda")
        assert torch.equal(triton_argmax.argmax_rows(logits), logits.argmax(dim=-1))
        fns = {"torch": functools.partial(torch.argmax, logits, dim=-1),
               "ours": functools.partial(triton_argmax.argmax_rows, logits)}  # fmt: skip
        eager = {name: do_bench(fn) * 1e3 for name, fn in fns.items()}
        graph = {name: triton.testing.do_bench_cudagraph(fn) * 1e3 for name, fn in fns.items()}
        out.append(_report(f"argmax_r{rows}", graph["ours"] / 1e3, torch_us=eager["torch"], ours_us=eager["ours"],
                           torch_graph_us=graph["torch"], ours_graph_us=graph["ours"],
                           floor_us=logits.numel() * 4 / HBM_BYTES_PER_S * 1e6))  # fmt: skip
    return out


def bench_act_fp8(rows_list: tuple[int, ...] = (1, 8, 16, 17, 32, 64, 256, 1024, 8192)) -> list[dict]:
    """``silu_and_mul_fp8`` against ``silu_and_mul`` then ``quantize_fp8_per_token`` (what it fuses),
    microseconds a call as the engine launches them, at Llama-3-8B's and Llama-3-70B's widths."""

    def unfused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_fp8.quantize_fp8_per_token(triton_pointwise.silu_and_mul(x))

    out = []
    for inter in (14336, 28672):
        for rows in rows_list:
            copies = [torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(4)]
            fused = triton_pointwise.silu_and_mul_fp8(copies[0])
            q, scale = unfused(copies[0])
            assert torch.equal(fused.scale, scale)
            assert torch.equal(fused.values.view(torch.uint8), q.view(torch.uint8))
            turn = itertools.cycle(copies)
            fns = {"unfused": lambda t=turn: unfused(next(t)),
                   "ours": lambda t=turn: triton_pointwise.silu_and_mul_fp8(next(t))}  # fmt: skip
            us = {name: do_bench(f, warmup=50, rep=300, return_mode="median") * 1e3
                  for name, f in fns.items()}  # fmt: skip
            floor_us = rows * inter * (2 * 2 + 1) / HBM_BYTES_PER_S * 1e6  # bf16 gate and up in, fp8 out
            out.append(_report(f"act_fp8_i{inter}_r{rows}", us["ours"] / 1e3, unfused_us=us["unfused"],
                               ours_us=us["ours"], speedup=us["unfused"] / us["ours"],
                               floor_us=floor_us))  # fmt: skip
    return out


def _weight_only(x, scale, weight, tiles):
    return triton_quant.weight_only_linear(x, weight, scale, None, False, tiles)


def _dense(x, weight, tiles):
    assert tiles is None, "dense_linear picks its own tiles"
    return triton_quant.dense_linear(x, weight)


def _fp8(q, x_scale, scale, weight, tiles):
    return triton_fp8.fp8_gemm_triton(q, x_scale, weight, scale, None, torch.bfloat16, tiles)


def _fp8_quantize_x(x, scale, weight, tiles):
    """One 16-bit row against an fp8 weight, quantized per token inside the one-row kernel, as
    ``fp8_linear`` runs it; ``tiles`` (1, BLOCK_N, BLOCK_K, warps, stages) of ``ONE_ROW_TILES``."""
    return triton_one_row.one_row_linear(x, weight, scale, quantize_x=True, tiles=tiles and tiles[1:4])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sweep", nargs="*", choices=["decode", "prefill", "gemm", "fused", "logits"], default=None,
        help="also time other tile configurations of these kernels (both when given bare)",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, nargs="+", default=[16], help="KV cache block sizes")
    parser.add_argument(
        "--blas", action="store_true", help="also time the model's linear shapes in cuBLAS and cuBLASLt"
    )
    parser.add_argument(
        "--gemm", action="store_true", help="the linears at decode's few rows: cuBLAS against our GEMMs"
    )
    parser.add_argument("--gemm-rows", type=int, nargs="+", default=[1, 16], help="rows of --gemm, --fused and --logits")
    parser.add_argument("--fused", action="store_true", help="also time the fused gate_up and q/k/v kernels against the unfused")
    parser.add_argument("--logits", action="store_true", help="also time the LM head, cuBLAS and the cast against ours")
    parser.add_argument("--argmax", action="store_true", help="also time the sampler's argmax, torch against ours")
    parser.add_argument(
        "--act-fp8", action="store_true", help="also time fp8's SiLU·mul quantizer against what it fuses"
    )
    parser.add_argument(
        "--decode-shape", type=int, nargs=2, default=[64, 2048], metavar=("BATCH", "CONTEXT"),
        help="sequences and context length of the decode case (default: 64 2048)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16"],
        help="KV cache dtypes of the decode case (fp8: e4m3, as kv_cache={'dtype': 'fp8'} stores it)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-lengths", type=int, nargs="+", default=[2048] * 8,
        help="prompt lengths of the prefill case, all fresh (default: 8 x 2048)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-cached", type=int, default=0,
        help="tokens each prompt of the prefill case has in the cache before its new ones (default: 0)",
    )  # fmt: skip
    parser.add_argument(
        "--mixed", action="store_true", help="also time mixed steps: the ragged kernel alone against the decode split"
    )
    parser.add_argument("--no-attention", action="store_true", help="skip the attention benchmarks")
    parser.add_argument("--json", help="write all rows to this file")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the kernel benchmarks need a CUDA device"
    torch.manual_seed(0)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": triton.__version__}))  # fmt: skip
    rows = []
    for block_size in [] if args.no_attention else args.block_size:
        sweep = set() if args.sweep is None else set(args.sweep or ("decode", "prefill", "gemm"))
        for kv_dtype in args.kv_dtype:
            rows += bench_decode("decode" in sweep, block_size, *args.decode_shape, kv_dtype)
        rows += bench_prefill("prefill" in sweep, block_size, args.prefill_lengths, args.prefill_cached)
        if args.mixed:
            rows += bench_mixed(block_size)
    if args.fused:
        rows += bench_fused_gate_up(tuple(args.gemm_rows), "fused" in (args.sweep or ()))
        rows += bench_fused_qkv_rotary(tuple(args.gemm_rows), "fused" in (args.sweep or ()))
        rows += bench_fused_qkv_rotary(tuple(args.gemm_rows), "fused" in (args.sweep or ()), fp8=True)
    if args.logits or "logits" in (args.sweep or ()):
        rows += bench_logits(tuple(args.gemm_rows), "logits" in (args.sweep or ()))
        rows += bench_int8_logits(tuple(args.gemm_rows))
    if args.argmax:
        rows += bench_argmax()
    if args.act_fp8:
        rows += bench_act_fp8()
    if args.blas:
        rows += bench_blas_libraries()
    gemm_sweep = args.sweep is not None and "gemm" in (args.sweep or ("gemm",))
    if args.gemm or gemm_sweep:
        rows += bench_decode_gemms(tuple(args.gemm_rows), gemm_sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    assert all(math.isfinite(r.get("ms", 0.0)) for r in rows)


if __name__ == "__main__":
    main()
