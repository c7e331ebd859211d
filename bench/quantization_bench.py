"""Quantization on one GPU: a Llama-3-8B-shaped model (random weights) in bf16, fp8 (both GEMMs), int8
and wf6af16, with transformers bf16 as the baseline, in one run (issue 14).

For each of our configurations (and bf16 weights over an fp8 KV cache):

1. batch-1 decode: one 512-token prompt generating 128 tokens, ms per output token, beside the
   weight-read floor (the bytes of every weight a decode step reads, at the measured HBM rate);
2. throughput: 256 requests x 512 prompt tokens x 256 generated, all at once (output tokens/s),
   against bf16's;
3. greedy agreement with bf16 over 64 prompts x 64 tokens: prompts identical, token positions that
   agree, mean position of the first difference. Random weights give near-tied logits, so these
   figures are a lower bound of what real weights give.

and first (``--gemm``) the linear layers' shapes at 1, 16, 256 and 8192 rows through every GEMM the
formats have: bf16 cuBLAS, int8 / FP6 fused Triton and dequantize + cuBLAS, fp8 Triton and
``torch._scaled_mm`` (activation quantization included), against their floors.

    PYTHONPATH=$PWD python3 bench/quantization_bench.py [--configs bf16 fp8-scaled_mm ...] [--no-hf]

``--tiny`` runs the same code on the CPU at a tiny shape (fp8 and the GEMM sweep need a GPU and are
skipped there), to check the script.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_benchmark
from checkpoints import LLAMA3_8B, write_random_llama
from gpu_benchmark import HBM_BYTES_PER_S, drive, random_prompts, report

# name -> (quantization_mode, fp8 GEMM, KV cache dtype)
CONFIGS: dict[str, tuple[str | None, str, str]] = {
    "bf16": (None, "auto", "auto"),
    "fp8": ("fp8", "auto", "auto"),  # what quantization_mode="fp8" runs: Triton at few rows, scaled_mm above
    "fp8-scaled_mm": ("fp8", "scaled_mm", "auto"),
    "fp8-triton": ("fp8", "triton", "auto"),
    "int8": ("int8", "auto", "auto"),
    "wf6af16": ("wf6af16", "auto", "auto"),
    "bf16-kv-fp8": (None, "auto", "fp8"),
    "fp8-kv-fp8": ("fp8", "auto", "fp8"),
}
TARGETS = {"fp8_batch1_ms": 2.6, "fp8_throughput_vs_bf16": 1.3}
TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}  # fmt: skip


def read_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from its weights: everything but the embedding (one row a token)."""
    params = sum(p.nbytes for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    scales = sum(b.nbytes for n, b in model.named_buffers() if n.endswith("weight_scale"))
    return params + scales


def batch1_ms(loop: Any, rng: torch.Generator, prompt: int, output: int) -> float:
    """ms per output token of one request, after a run of the same shape."""
    for _ in range(2):
        _, tracker, _ = drive(loop, random_prompts(rng, [prompt]), [output])
    return tracker.ms_per_step()


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(reference, other)]
    positions = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    return {
        "prompts_identical": sum(r == o for r, o in zip(reference, other)) / len(reference),
        "positions_identical": positions / sum(len(r) for r in reference),
        "mean_first_difference": sum(firsts) / len(firsts),
    }


def run_config(name: str, path: Path, args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    """Load one configuration, measure it, free it; ``base`` holds bf16's figures once measured."""
    from mii_server import gc_heap
    from mii_server.config import ModelConfig
    from mii_server.runtime import build_loop, build_runtime

    mode, gemm, kv_dtype = CONFIGS[name]
    os.environ["MII_SERVER_FP8_GEMM"] = gemm
    start = time.perf_counter()
    config = ModelConfig(
        model_name_or_path=str(path), dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device, quantization_mode=mode, max_ragged_batch_size=args.batch_tokens,
        max_ragged_sequence_count=256, max_tracked_sequences=512, cuda_graph_max_batch=256,
        kv_cache={"dtype": kv_dtype},
    )  # fmt: skip
    runtime = build_runtime(config)
    loop = build_loop(config, runtime)
    gc_heap.freeze_startup_heap(name)  # as pipeline() and the replica run the engine
    read_bytes = read_bytes_per_step(runtime.loaded.model)
    floor_ms = read_bytes / HBM_BYTES_PER_S * 1e3
    report(f"{name}_loaded", seconds=time.perf_counter() - start, weight_read_gib=read_bytes / 2**30,
           kv_blocks=runtime.engine.total_blocks)
    rng = torch.Generator().manual_seed(0)
    drive(loop, random_prompts(rng, [600, 37, 5]), [20, 9, 40])  # warm-up: compile the eager shapes
    drive(loop, random_prompts(rng, [40] * 16), [4] * 16)

    row: dict[str, Any] = {"config": name, "weight_read_floor_ms": floor_ms}
    row["batch1_ms"] = batch1_ms(loop, rng, 512, args.latency_tokens)
    n, p, o = args.requests, 512, args.output
    seconds, _, _ = drive(loop, random_prompts(rng, [p] * n), [o] * n)
    row["throughput_tokens_per_s"] = n * o / seconds
    agree_rng = torch.Generator().manual_seed(7)  # the same prompts for every configuration
    _, tracker, _ = drive(loop, random_prompts(agree_rng, [128] * args.agree_prompts), [64] * args.agree_prompts)
    tokens = [tracker.token_ids[uid] for uid in sorted(tracker.token_ids)]
    if name == "bf16":
        base.update(row, tokens=tokens)
    else:
        row |= agreement(base["tokens"], tokens) if "tokens" in base else {}
        if "throughput_tokens_per_s" in base:
            row["throughput_vs_bf16"] = row["throughput_tokens_per_s"] / base["throughput_tokens_per_s"]
            row["batch1_speedup_vs_bf16"] = base["batch1_ms"] / row["batch1_ms"]
    row["frac_floor_batch1"] = floor_ms / row["batch1_ms"]
    report(name, **row)
    del loop, runtime
    gc_heap.unfreeze_and_collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def _gemm_variants(x: torch.Tensor, w: dict[str, Any]) -> dict[str, tuple[Callable[[], Any], float]]:
    """name -> (the product of x with one layer's weight in that format, bytes a weight)."""
    from mii_server.kernels import triton_fp8, triton_quant

    return {
        "bf16_cublas": (lambda: torch.nn.functional.linear(x, w["bf16"]), 2),
        "int8_fused": (lambda: triton_quant.int8_linear(x, *w["int8"]), 1),
        "fp6_fused": (lambda: triton_quant.fp6_linear(x, *w["fp6"]), 0.75),
        "fp8_triton": (lambda: triton_fp8.fp8_linear(x, *w["fp8"], gemm="triton"), 1),
        "fp8_scaled_mm": (lambda: triton_fp8.fp8_linear(x, *w["fp8"], gemm="scaled_mm"), 1),
    }


def gemm_sweep() -> None:
    """Every format's GEMM at Llama-3-8B's linear shapes, against the larger of its floors."""
    from triton.testing import do_bench

    from mii_server.kernels import triton_quant
    from mii_server.quantization.quantize import quantize_fp6, quantize_fp8, quantize_int8

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    fused_rows = triton_quant.DEQUANT_MIN_ROWS
    for layer, (n, k) in shapes.items():
        full = torch.randn(n, k, device="cuda") * 0.02
        weights = {"bf16": full.to(torch.bfloat16), "int8": quantize_int8(full, 0, k),
                   "fp6": quantize_fp6(full, 0, k), "fp8": quantize_fp8(full, 0, k)}  # fmt: skip
        del full
        for m in (1, 16, 256, 8192):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for variant, (fn, bytes_per_weight) in _gemm_variants(x, weights).items():
                triton_quant.DEQUANT_MIN_ROWS = 1 << 30  # the fused kernel at every row count
                ms = do_bench(fn, rep=50)
                floor = max(n * k * bytes_per_weight / HBM_BYTES_PER_S, 2 * m * n * k / gpu_benchmark.BF16_FLOPS)
                fields = {"ms": ms, "frac_floor": floor * 1e3 / ms}
                if variant in ("int8_fused", "fp6_fused"):
                    triton_quant.DEQUANT_MIN_ROWS = 0  # the dequantize + cuBLAS path, for the same product
                    fields["dequant_cublas_ms"] = do_bench(fn, rep=50)
                report("gemm", layer=layer, rows=m, variant=variant, **fields)
    triton_quant.DEQUANT_MIN_ROWS = fused_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM sweep")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (checks the script)")
    parser.add_argument("--weights", help="checkpoint directory, made once (default: /tmp/llama3-8b-random)")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="max_ragged_batch_size")
    parser.add_argument("--requests", type=int, default=256, help="throughput: requests of 512 prompt tokens")
    parser.add_argument("--output", type=int, default=256, help="throughput: tokens generated per request")
    parser.add_argument("--latency-tokens", type=int, default=128, help="batch-1: tokens generated")
    parser.add_argument("--agree-prompts", type=int, default=64, help="agreement: prompts of 64 tokens")
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers batch for its throughput")
    parser.add_argument("--hf-tokens", type=int, default=32, help="longer transformers generation length")
    parser.add_argument("--json", help="write every result row to this file")
    args = parser.parse_args()
    os.environ.setdefault("MII_SERVER_PROGRESS", "0")
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("mii_server").setLevel(logging.INFO)
    args.device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        # why: gpu_benchmark's prompt helpers draw ids from its SHAPE's vocabulary
        gpu_benchmark.SHAPE = TINY
        args.configs = [c for c in args.configs if CONFIGS[c][0] != "fp8"]  # no fp8 on the CPU
        args.no_gemm = True
    else:
        assert torch.cuda.is_available(), "this benchmark needs a CUDA device (or --tiny)"
    run_start = time.perf_counter()
    weights = Path(args.weights or ("/tmp/llama-tiny-random" if args.tiny else "/tmp/llama3-8b-random"))
    path = write_random_llama(weights, TINY if args.tiny else LLAMA3_8B, shards=1 if args.tiny else 4)
    if not args.no_gemm:
        gemm_sweep()
    hf: dict[str, float] = {}
    if not args.no_hf:
        hf = gpu_benchmark.run_hf(path, argparse.Namespace(only=["throughput", "latency"], hf_batch=args.hf_batch,
                                                           hf_tokens=args.hf_tokens))  # fmt: skip
    base: dict[str, Any] = {}
    rows = [run_config(name, path, args, base) for name in args.configs]
    fp8 = [r for r in rows if CONFIGS[r["config"]][0] == "fp8"]
    targets = TARGETS | {
        "fp8_best_batch1_ms": min((r["batch1_ms"] for r in fp8), default=None),
        "fp8_best_throughput_vs_bf16": max((r.get("throughput_vs_bf16", 0.0) for r in fp8), default=None),
    }
    columns = ("batch1_ms", "weight_read_floor_ms", "throughput_tokens_per_s", "positions_identical")
    report("summary", table={r["config"]: {c: r.get(c) for c in columns} for r in rows},
           hf_batch1_ms=hf.get("latency_ms"), hf_throughput_tokens_per_s=hf.get("throughput"),
           targets=targets, seconds=time.perf_counter() - run_start)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(gpu_benchmark.RESULTS, indent=1))


if __name__ == "__main__":
    main()
