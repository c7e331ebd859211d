"""Tensor parallelism on several GPUs: TP=2 against TP=1 and against two TP=1 replicas, one run.

Each layout is a real deployment (``serve()``: supervisor, load balancer, replicas) on the same
random-weight checkpoint (Llama-3-8B shape by default). Measured through the client, as users see it:
  - agreement: greedy tokens of TP=2 vs TP=1 (bf16 all-reduce order differs, so some drift is expected)
  - batch-1 decode: per-token latency of one prompt (stream timestamps), with the bandwidth floor
  - offline throughput: N requests submitted at once, output tokens/s
Ratios are printed against TP=1 measured in the same run.

    python bench/tensor_parallel_bench.py --model-dir /tmp/llama3-8b
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import LLAMA3_8B, word_text, write_random_llama

import mii_server

HBM_BYTES_PER_S = 4.24e12  # measured H200 copy bandwidth (KINDS.md)


def make_prompts(count: int, length: int, seed: int) -> list[str]:
    """``count`` texts of exactly ``length`` random tokens (of the checkpoint's word-level vocabulary)."""
    rng = random.Random(seed)
    return [word_text([rng.randrange(3, LLAMA3_8B["vocab_size"]) for _ in range(length)]) for _ in range(count)]


def weight_bytes(shape: dict) -> float:
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * i
    return 2.0 * (layers * per_layer + v * h)  # bf16; the embedding table is gathered, not streamed


def measure(client, args, agree_prompts, long_prompt, batch_prompts) -> dict:
    out: dict = {}
    agree = client.generate(agree_prompts, max_new_tokens=args.agree_tokens, do_sample=False, ignore_eos=True)
    out["agree_ids"] = [r.token_ids for r in agree]
    if args.agreement_only:
        return out
    # batch-1 decode latency (warm up once, then measure)
    client.generate([long_prompt], max_new_tokens=8, do_sample=False, ignore_eos=True)
    stamps = []
    for _chunk in client.generate_stream([long_prompt], max_new_tokens=args.gen_len, do_sample=False, ignore_eos=True):
        stamps.append(time.perf_counter())
    out["ms_per_token"] = 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    start = time.perf_counter()
    replies = client.generate(batch_prompts, max_new_tokens=args.gen_len, do_sample=False, ignore_eos=True)
    elapsed = time.perf_counter() - start
    out["tokens_per_s"] = sum(r.generated_length for r in replies) / elapsed
    out["prompt_tokens"] = sum(r.prompt_length for r in replies) / len(replies)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/llama3-8b-random"))
    ap.add_argument("--agree-prompts", type=int, default=64)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=50050)
    ap.add_argument("--layouts", default="tp1,tp2,2x-tp1")
    ap.add_argument("--reserve-gb", type=float, default=4.0, help="GPU memory each rank leaves outside the KV cache")
    ap.add_argument("--dtype", default="auto", help="weights and activations (auto = bfloat16 on GPUs)")
    ap.add_argument("--agreement-only", action="store_true", help="skip the latency and throughput runs")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    path = write_random_llama(args.model_dir, LLAMA3_8B)
    agree_prompts = make_prompts(args.agree_prompts, 64, seed=1)
    long_prompt = make_prompts(1, args.prompt_len, seed=2)[0]
    batch_prompts = make_prompts(args.requests, args.prompt_len, seed=3)
    layouts = {"tp1": {"tensor_parallel": 1}, "tp2": {"tensor_parallel": 2}, "2x-tp1": {"replica_num": 2}}
    results = {}
    for index, name in enumerate(args.layouts.split(",")):
        t0 = time.perf_counter()
        # a fresh port block per layout: the previous one's sockets may linger in FIN_WAIT
        port = args.port + 10 * index
        client = mii_server.serve(
            str(path), deployment_name=f"tp-bench-{name}", port_number=port,
            kv_cache={"reserve_bytes": int(args.reserve_gb * 2**30)}, dtype=args.dtype, **layouts[name],
        )  # fmt: skip
        print(f"[{name}] ready in {time.perf_counter() - t0:.0f}s", flush=True)
        try:
            results[name] = measure(client, args, agree_prompts, long_prompt, batch_prompts)
        finally:
            client.terminate_server()
            client.close()
        r = results[name]
        if args.agreement_only:
            continue
        print(f"[{name}] batch-1 {r['ms_per_token']:.2f} ms/token; {r['tokens_per_s']:,.0f} output tokens/s", flush=True)

    if not args.agreement_only:
        print_speed_table(results, args)
    print_agreement(results, args)
    if args.json:
        args.json.write_text(json.dumps({k: {m: v for m, v in r.items() if m != "agree_ids"} for k, r in results.items()}))


def print_speed_table(results: dict, args: argparse.Namespace) -> None:
    floor = weight_bytes(LLAMA3_8B) / HBM_BYTES_PER_S * 1000
    print(f"\nLlama-3-8B shape, {args.dtype}, {args.requests} requests x ~{results[next(iter(results))]['prompt_tokens']:.0f} "
          f"prompt tokens x {args.gen_len} generated; batch-1: one prompt, {args.gen_len} tokens")  # fmt: skip
    print(f"{'layout':8} {'ms/token':>9} {'floor':>7} {'vs tp1':>7} {'tokens/s':>10} {'vs tp1':>7}")
    base = results.get("tp1")
    for name, r in results.items():
        gpus_per_replica = 2 if name == "tp2" else 1
        lat_ratio = base["ms_per_token"] / r["ms_per_token"] if base else float("nan")
        thr_ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        print(f"{name:8} {r['ms_per_token']:9.2f} {floor / gpus_per_replica:7.2f} {lat_ratio:6.2f}x "
              f"{r['tokens_per_s']:10,.0f} {thr_ratio:6.2f}x")  # fmt: skip


def print_agreement(results: dict, args: argparse.Namespace) -> None:
    if "tp1" in results and "tp2" in results:
        a, b = results["tp1"]["agree_ids"], results["tp2"]["agree_ids"]
        same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        total = sum(len(ra) for ra in a)
        prefix = [next((k for k, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]
        print(f"\nTP=2 vs TP=1 greedy agreement over {len(a)} prompts x {args.agree_tokens} tokens: "
              f"{same / total:.1%} of positions identical; {sum(p == len(r) for p, r in zip(prefix, a))}/{len(a)} "
              f"prompts identical throughout; mean identical prefix {sum(prefix) / len(prefix):.1f} tokens "
              f"({args.dtype})")  # fmt: skip


if __name__ == "__main__":
    main()
