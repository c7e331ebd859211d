"""Mixture-of-experts on the GPU: a Mixtral-8x7B-shaped model with random bf16 weights, ours vs
transformers on the same files in the same run (issue 13).

The checkpoint is Mixtral-8x7B's shape (hidden 4096, 32 / 8 heads, 8 experts of intermediate 14336,
top 2, vocabulary 32000) with its 32 layers cut to ``--layers`` (default 8: 11.9 B parameters,
22.1 GiB of bf16 on disk and on the GPU, so transformers' copy, ours and the KV cache fit one H200 in
turn and the files fit its 64 GiB disk). Every layer is alike, so per-layer figures carry over to
the full model. Written once (random weights made on the GPU, saved in the hub's per-expert layout).

Scenarios, each printed beside its roofline and the transformers baseline:

1. kernels: the fused MoE (router + sort + two grouped GEMMs) of one layer at decode batch 1 and 256
   and a prefill chunk of 8192 tokens, against the reference (a loop over experts with one GEMM
   each): time, GB/s of expert weights read, TFLOP/s (``--sweep-tiles`` also tries other tiles);
2. throughput: 256 requests x 512 prompt tokens x 256 generated, all submitted at once (output tok/s);
3. latency: one 512-token prompt generating 256 tokens (ms per output token).

The decode roofline is the bytes a step must read at H200's 4.8 TB/s (spec sheet; the measured
copy rate, 4.24 TB/s, is printed beside it): the active parameters (attention, the router, the
experts the batch's tokens pick: top-2 of 8 at batch 1, all 8 at batch 256) plus the KV cache. The
transformers figures come from ``gpu_benchmark.run_hf`` (two generation lengths, extrapolated).

    PYTHONPATH=. python3 bench/moe_benchmark.py [--only kernels throughput latency] [--layers 8]
    PYTHONPATH=. python3 bench/moe_benchmark.py --tiny      # CPU smoke test at a tiny shape
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_benchmark as gb
from checkpoints import MIXTRAL_8X7B, write_random_mixtral

HBM_SPEC_BYTES_PER_S = 4.8e12  # H200 spec sheet
SCENARIOS = ("kernels", "throughput", "latency")
TINY = dict(
    MIXTRAL_8X7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, max_position_embeddings=2048,
)  # fmt: skip


class Shape:
    """Parameter and byte counts of a Mixtral shape."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        self.layers = cfg["num_hidden_layers"]
        self.experts, self.top_k, self.vocab = cfg["num_local_experts"], cfg["num_experts_per_tok"], v
        head_dim = h // cfg["num_attention_heads"]
        kv = cfg["num_key_value_heads"] * head_dim
        self.attention = h * (h + 2 * kv) + h * h  # q, k, v, o
        self.expert = 3 * h * i  # w1, w3, w2
        self.router = self.experts * h
        self.head = v * h
        self.total = self.layers * (self.attention + self.router + self.experts * self.expert) + 2 * self.head
        self.kv_bytes_per_token = self.layers * 2 * kv * 2
        self.hidden = h

    def experts_touched(self, batch: int) -> float:
        """Expected distinct experts a layer runs for ``batch`` tokens routed uniformly at random."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** batch)

    def step_weight_bytes(self, batch: int) -> float:
        """bf16 bytes of the weights one decode step of ``batch`` sequences must read."""
        per_layer = self.attention + self.router + self.experts_touched(batch) * self.expert
        return 2 * (self.layers * per_layer + self.head)

    def active_params(self) -> int:
        """Parameters one token's forward multiplies (top-k experts), the LM head excluded."""
        return self.layers * (self.attention + self.router + self.top_k * self.expert)


def throughput_floor_seconds(shape: Shape, prompts: list[int], outputs: list[int]) -> float:
    """bf16 compute floor of the prefills plus the HBM floor of the decode steps (at the spec rate)."""
    flops = sum(
        2 * shape.active_params() * n + 2 * shape.head + shape.layers * 4 * shape.hidden * n * n / 2 for n in prompts
    )
    steps = max(outputs) - 1
    running = [sum(1 for o in outputs if o > j) for j in range(1, steps + 1)]
    weights = sum(shape.step_weight_bytes(b) for b in running)
    kv = sum(shape.kv_bytes_per_token * sum(p + j for j in range(1, o)) for p, o in zip(prompts, outputs))
    return flops / gb.BF16_FLOPS + (weights + kv) / HBM_SPEC_BYTES_PER_S


# ---- the fused MoE op alone ----------------------------------------------------------------------


def _moe_layer(ops: Any, x: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               **options: Any) -> torch.Tensor:  # fmt: skip
    """One MoE layer's work past its router GEMM: route, then the fused expert MLP."""
    weights, ids = ops.moe_route(x @ gate.T, top_k, True)
    return ops.fused_moe(x, w13, w2, weights, ids, **options)


def bench_kernels(cfg: dict[str, Any], args: argparse.Namespace) -> None:
    from functools import partial

    import triton

    from mii_server.kernels import reference, triton_moe

    shape = Shape(cfg)
    h, i, e, k = cfg["hidden_size"], cfg["intermediate_size"], shape.experts, shape.top_k
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    gate = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
    sweep = [
        triton_moe.MoETiles(bm, bn, bk, gm, w, st)
        for bm, bn, bk, gm, w, st in [
            (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 3),
            (32, 64, 128, 4, 4, 4), (64, 64, 64, 8, 4, 3), (64, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3),
        ]
    ]  # fmt: skip
    for tokens in (1, 256, 8192):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        ours = partial(_moe_layer, triton_moe, x, gate, w13, w2, k)
        theirs = partial(_moe_layer, reference, x, gate, w13, w2, k)
        max_diff = (ours().float() - theirs().float()).abs().max().item()  # tests/ check it; here it is shown
        touched = shape.experts_touched(tokens) * shape.expert * 2  # bf16 bytes of expert weights read
        flops = 2 * tokens * k * shape.expert
        ms = triton.testing.do_bench(ours, warmup=10, rep=50)
        ref_ms = triton.testing.do_bench(theirs, warmup=3, rep=20)
        row = {"tokens": tokens, "max_abs_diff_vs_reference": max_diff, "ms": ms, "weights_gb_per_s": touched / ms / 1e6,
               "frac_hbm_spec": touched / ms / 1e-3 / HBM_SPEC_BYTES_PER_S, "tflops": flops / ms / 1e9,
               "frac_bf16": flops / ms / 1e-3 / gb.BF16_FLOPS, "reference_ms": ref_ms, "speedup": ref_ms / ms,
               "tiles": triton_moe.moe_tiles(tokens * k, e, True).__dict__}  # fmt: skip
        if args.sweep_tiles:
            timed = [(triton.testing.do_bench(partial(ours, tiles=t), warmup=5, rep=25), t) for t in sweep]
            row["sweep"] = [(round(m, 4), t.__dict__) for m, t in sorted(timed, key=lambda pair: pair[0])]
        gb.report("moe_kernel", **row)
    torch.cuda.empty_cache()


# ---- our engine ----------------------------------------------------------------------------------


def run_ours(path: Path, cfg: dict[str, Any], args: argparse.Namespace, hf: dict[str, float]) -> None:
    shape = Shape(cfg)
    start = time.perf_counter()
    _, runtime, loop = gb.start_ours(path, args)
    engine = runtime.engine
    graphs = engine.cuda_graphs
    gb.report("ours_loaded", seconds=time.perf_counter() - start, kv_blocks=engine.total_blocks,
              block_size=engine.block_size, graph_rungs=None if graphs is None else len(graphs.batch_sizes),
              graph_pool_mib=None if graphs is None else graphs.pool_bytes / 2**20)  # fmt: skip
    rng = torch.Generator().manual_seed(0)
    vocab = shape.vocab
    n, p, o = (256, 512, 256) if not args.tiny else (8, 32, 8)
    gb.drive(loop, gb.random_prompts(rng, [600, 37, 1100, 5], vocab), [20, 9, 3, 40])  # warm-up
    gb.drive(loop, gb.random_prompts(rng, [40] * 16, vocab), [4] * 16)

    if "throughput" in args.only:
        seconds, _, _ = gb.drive(loop, gb.random_prompts(rng, [p] * n, vocab), [o] * n)
        tps = n * o / seconds
        floor = throughput_floor_seconds(shape, [p] * n, [o] * n)
        gb.report("throughput", requests=n, prompt=p, output=o, seconds=seconds, output_tokens_per_s=tps,
                  roofline_tokens_per_s=n * o / floor, frac_roofline=tps * floor / (n * o),
                  hf_tokens_per_s=hf.get("throughput"), vs_hf=gb.ratio(tps, hf.get("throughput")), target_vs_hf=3.0,
                  preemptions=loop.scheduler.num_preemptions)  # fmt: skip

    if "latency" in args.only:
        lp, lo = (512, 256) if not args.tiny else (32, 16)
        per_token = []
        for _ in range(2):  # the first run warms up what the throughput run did not
            _, tracker, _ = gb.drive(loop, gb.random_prompts(rng, [lp], vocab), [lo])
            per_token.append(tracker.ms_per_step())
        step_bytes = shape.step_weight_bytes(1) + shape.kv_bytes_per_token * (lp + lo // 2)
        floor_ms = step_bytes / HBM_SPEC_BYTES_PER_S * 1e3
        ms = per_token[-1]
        gb.report("latency", prompt=lp, output=lo, ms_per_token=ms, warmup_ms_per_token=per_token[0],
                  active_weight_gb=shape.step_weight_bytes(1) / 1e9, floor_ms=floor_ms,
                  floor_ms_at_measured_hbm=step_bytes / gb.HBM_BYTES_PER_S * 1e3, vs_floor=ms / floor_ms,
                  target_vs_floor=1.5, hf_ms_per_token=hf.get("latency_ms"),
                  speedup_vs_hf=gb.ratio(hf.get("latency_ms", 0.0), ms))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="scenarios to run")
    parser.add_argument("--layers", type=int, default=8, help="Mixtral-8x7B's 32 layers cut to this many")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, small workloads (CPU smoke test)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-graphs", action="store_true", help="run our engine without CUDA graphs")
    parser.add_argument("--sweep-tiles", action="store_true", help="kernels: also time other MoE tiles")
    parser.add_argument("--weights", default=None, help="checkpoint directory (made once)")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="our max_ragged_batch_size")
    parser.add_argument("--hf-batch", type=int, default=128, help="transformers batch for the throughput baseline")
    parser.add_argument("--hf-tokens", type=int, default=48, help="longer of the two transformers generation lengths")
    parser.add_argument("--reserve-gb", type=float, default=1.0, help="our kv_cache.reserve_bytes, in GB")
    parser.add_argument("--json", help="write every result row to this file")
    args = parser.parse_args()
    os.environ.setdefault("MII_SERVER_PROGRESS", "0")
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("mii_server").setLevel(logging.INFO)
    import transformers

    if not args.tiny:
        assert gb.DEVICE == "cuda", "this benchmark needs a CUDA device (--tiny runs anywhere)"
    cfg = TINY if args.tiny else dict(MIXTRAL_8X7B, num_hidden_layers=args.layers)
    if args.tiny:
        args.hf_batch, args.hf_tokens = min(args.hf_batch, 4), min(args.hf_tokens, 24)
    shape = Shape(cfg)
    gb.report("machine", device=torch.cuda.get_device_name() if gb.DEVICE == "cuda" else "cpu",
              torch=torch.__version__, transformers=transformers.__version__, date=time.strftime("%Y-%m-%d"),
              argv=sys.argv[1:], layers=shape.layers, params_b=shape.total / 1e9,
              active_params_b=(shape.active_params() + shape.head) / 1e9)  # fmt: skip
    if "kernels" in args.only and gb.DEVICE == "cuda":
        torch.manual_seed(0)
        bench_kernels(cfg, args)
    start = time.perf_counter()
    default = f"/tmp/mixtral-8x7b-{shape.layers}l-random" if not args.tiny else "/tmp/mixtral-tiny-random"
    path = write_random_mixtral(Path(args.weights or default), cfg)
    gb.report("checkpoint_ready", seconds=time.perf_counter() - start, path=str(path))
    wanted = {"throughput", "latency"} & set(args.only)
    hf = {} if args.no_hf or not wanted else gb.run_hf(path, args)
    if wanted:
        run_ours(path, cfg, args, hf)
    if args.json:
        Path(args.json).write_text(json.dumps(gb.RESULTS, indent=1))


if __name__ == "__main__":
    main()
