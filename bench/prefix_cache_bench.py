"""Prefix caching on a GPU: time to first token of many requests that share a long prefix, with the
cache off and on, in one run (issue 16's target: p50 at least 5x lower with it on).

256 requests (random token ids) share a 2,048-token prefix, each with its own 64-token suffix and
128 new tokens, all submitted at once to one engine (the Llama-3-8B-shaped random checkpoint of
``bench/gpu_benchmark.py``, bf16). The same loaded engine runs both: first with its scheduler's
prefix reuse switched off (every prompt computed in full), then on. Printed per run: TTFT p50 / p99,
wall time, prompt tokens served from the cache; then the p50 ratio, and how many outputs agree
token for token (greedy; bf16 sums in other batch shapes may flip a near-tie, so this is reported,
not asserted: tests/engine/test_prefix_caching.py asserts equality in float32).

    PYTHONPATH=. python3 bench/prefix_cache_bench.py                 # H200: about 4 minutes
    PYTHONPATH=. python3 bench/prefix_cache_bench.py --tiny          # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_benchmark import drive, prefill_seconds


def run(
    loop: Any, prompts: list[list[int]], new: int, caching: bool
) -> tuple[dict[str, Any], list[list[int]]]:
    """One pass over ``prompts``; returns its figures and each prompt's output ids."""
    loop.scheduler.prefix_caching = caching  # off: nothing is reused nor registered
    cached_before = loop.scheduler.cached_prompt_tokens
    seconds, tracker, submitted = drive(loop, prompts, [new] * len(prompts))
    ttft = sorted(tracker.first[uid] - submitted[uid] for uid in submitted)
    row = {
        "caching": caching,
        "seconds": round(seconds, 3),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p99_s": round(ttft[int(0.99 * (len(ttft) - 1))], 4),
        "cached_prompt_tokens": loop.scheduler.cached_prompt_tokens - cached_before,
        "prompt_tokens": sum(len(p) for p in prompts),
    }
    return row, [tracker.token_ids[uid] for uid in sorted(submitted)]  # uids are handed out in prompt order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=8192, help="max_ragged_batch_size")
    ap.add_argument("--weights", default="/tmp/llama3-8b-random", help="checkpoint directory (made once)")
    ap.add_argument("--reserve-gb", type=float, default=1.0)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU (smoke test)")
    args = ap.parse_args()

    from mii_server.config import ModelConfig
    from mii_server.runtime import build_loop, build_runtime

    if args.tiny:
        from mii_server.demo_model import build_tiny_checkpoint

        args.requests, args.prefix, args.suffix, args.new, args.batch_tokens = 16, 96, 8, 4, 256
        path = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", max_position_embeddings=256)
        vocab = 384
        config = ModelConfig(model_name_or_path=str(path), device="cpu", max_ragged_batch_size=args.batch_tokens,
                             max_ragged_sequence_count=64, kv_cache={"block_size": 16, "num_blocks": 256})  # fmt: skip
    else:
        from checkpoints import LLAMA3_8B, write_random_llama

        assert torch.cuda.is_available(), "without --tiny this benchmark needs a CUDA device"
        path = write_random_llama(Path(args.weights))
        vocab = LLAMA3_8B["vocab_size"]
        config = ModelConfig(model_name_or_path=str(path), dtype="bfloat16", device="cuda",
                             max_ragged_batch_size=args.batch_tokens, max_ragged_sequence_count=512,
                             kv_cache={"reserve_bytes": int(args.reserve_gb * 1e9)})  # fmt: skip
    runtime = build_runtime(config)
    loop = build_loop(config, runtime)
    rng = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, vocab - 1, (n,), generator=rng).tolist()
    warm = [30, 7, 50] if args.tiny else [300, 37, 1000]
    drive(loop, [ids(n) for n in warm], [8, 3, 2])  # warm-up: the kernels compile
    prefix = ids(args.prefix)
    prompts = [prefix + ids(args.suffix) for _ in range(args.requests)]
    rows, outputs = [], []
    for caching in (False, True):
        row, ids_out = run(loop, prompts, args.new, caching)
        rows.append(row)
        outputs.append(ids_out)
        print(json.dumps(row), flush=True)
    off, on = rows
    agree = sum(a == b for a, b in zip(*outputs))
    floor_off = prefill_seconds([len(p) for p in prompts]) if not args.tiny else None
    print(json.dumps({
        "bench": "prefix_cache", "requests": args.requests, "prefix": args.prefix, "suffix": args.suffix,
        "new": args.new, "ttft_p50_ratio_off_on": round(off["ttft_p50_s"] / on["ttft_p50_s"], 2), "target_ratio": 5,
        "wall_ratio_off_on": round(off["seconds"] / on["seconds"], 2),
        "prefill_roofline_off_s": None if floor_off is None else round(floor_off, 3),
        "outputs_agreeing": f"{agree}/{len(prompts)}",
        "kv_blocks": runtime.engine.total_blocks, "cached_blocks_after": runtime.engine.cached_blocks,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
