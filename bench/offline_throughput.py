"""Offline throughput: N prompts through ``mii_server.pipeline()`` against Hugging Face ``generate``.

Both run the same checkpoint in the same process, greedy, with EOS ignored so every prompt yields
exactly ``--gen-len`` tokens. Hugging Face runs batches of ``--hf-batch`` prompts with left padding;
the pipeline takes all prompts at once and batches them itself (ragged, continuous). The two
alternate for ``--repeats`` rounds and each keeps its fastest round, so a burst of load from other
processes on a shared machine skews the ratio less. Printed: output tokens/s of each and the ratio
pipeline / HF, plus how many outputs agree token for token.

With no ``--model``, a small random-weight Llama (hidden 256, 4 layers) is built in a temporary
directory, so the script needs no download. Run from the repository root:

    python bench/offline_throughput.py                      # CPU-sized defaults, about a minute
    python bench/offline_throughput.py --device cuda --num-prompts 256 --gen-len 256 --hf-batch 64
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import mii_server
from mii_server.demo_model import build_tiny_checkpoint

BENCH_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}

WORDS = (  # noqa: SIM905 (a sentence reads better than a list of words)
    "the quick brown fox jumps over lazy dog model server answers requests for text large language "
    "models predict next token ragged batching packs many sequences into one forward pass blocked "
    "cache holds keys deployments have replicas load balancer gateway clients stream tokens"
).split()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint directory or hub id; empty builds a random Llama")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (about)")
    p.add_argument("--gen-len", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--hf-batch", type=int, default=8, help="prompts per Hugging Face generate call")
    p.add_argument("--repeats", type=int, default=3, help="alternating timed rounds; the fastest counts")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads; 0: one on the CPU (a small model is bound by per-op overhead, and OpenMP "
        "spin-waits collapse when another process shares the cores), torch's default on CUDA",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[str]:
    """``n`` different texts of about ``length`` tokens each."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(length * 2))
        prompts.append(tokenizer.decode(tokenizer.encode(words)[:length]))
    return prompts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pipeline(pipe: Any, prompts: list[str], gen_len: int) -> list[list[int]]:
    responses = pipe(prompts, max_new_tokens=gen_len, do_sample=False, ignore_eos=True)
    return [r.token_ids for r in responses]


def run_hf(model: Any, tokenizer: Any, prompts: list[str], gen_len: int, batch: int) -> list[list[int]]:
    outputs: list[list[int]] = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            enc = tokenizer(prompts[i : i + batch], return_tensors="pt", padding=True).to(model.device)
            out = model.generate(
                **enc,
                max_new_tokens=gen_len,
                min_new_tokens=gen_len,  # EOS ignored: every prompt yields gen_len tokens
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            outputs.extend(out[:, enc["input_ids"].shape[1] :].tolist())
    return outputs


def timed(fn: Callable[[], list[list[int]]], device: torch.device) -> tuple[float, list[list[int]]]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def rounds(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def main() -> None:
    args = parse_args()
    cpu_run = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if args.threads or cpu_run:
        torch.set_num_threads(args.threads or 1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="mii-bench-") as tmp:
        model_path = args.model or str(
            build_tiny_checkpoint(Path(tmp) / "llama", "llama", seed=0, **BENCH_MODEL)
        )
        pipe = mii_server.pipeline(model_path, dtype=args.dtype, device=args.device)
        assert pipe.runtime is not None
        device, dtype = pipe.runtime.loaded.device, pipe.runtime.loaded.dtype
        prompts = make_prompts(pipe.tokenizer, args.num_prompts, args.prompt_len, args.seed)
        prompt_tokens = sum(len(pipe.tokenizer.encode(p)) for p in prompts)
        tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()

        run_pipeline(pipe, prompts[:2], 4)  # warm-up
        run_hf(model, tokenizer, prompts[:2], 4, args.hf_batch)
        mii_times, hf_times = [], []
        for _ in range(args.repeats):
            seconds, mii_out = timed(lambda: run_pipeline(pipe, prompts, args.gen_len), device)
            mii_times.append(seconds)
            seconds, hf_out = timed(
                lambda: run_hf(model, tokenizer, prompts, args.gen_len, args.hf_batch), device
            )
            hf_times.append(seconds)
        pipe.destroy()
        mii_s, hf_s = min(mii_times), min(hf_times)

    out_tokens = args.num_prompts * args.gen_len
    assert sum(map(len, mii_out)) == out_tokens and sum(map(len, hf_out)) == out_tokens
    same = sum(a == b for a, b in zip(mii_out, hf_out))
    mii_tps, hf_tps = out_tokens / mii_s, out_tokens / hf_s
    print(f"model: {args.model or 'random Llama ' + str(BENCH_MODEL)}")
    print(
        f"device: {device}, dtype: {str(dtype).removeprefix('torch.')}, torch threads: {torch.get_num_threads()}"
    )
    print(
        f"{args.num_prompts} prompts, {prompt_tokens} prompt tokens (~{args.prompt_len} each), "
        f"{args.gen_len} new tokens each, HF batch {args.hf_batch}, best of {args.repeats} rounds"
    )
    print(
        f"mii_server.pipeline: {mii_s:8.2f} s  {mii_tps:10.1f} output tokens/s  (rounds: {rounds(mii_times)} s)"
    )
    print(
        f"HF generate:         {hf_s:8.2f} s  {hf_tps:10.1f} output tokens/s  (rounds: {rounds(hf_times)} s)"
    )
    print(f"ratio pipeline / HF: {mii_tps / hf_tps:.2f}x")
    print(f"identical greedy outputs: {same}/{args.num_prompts}")


if __name__ == "__main__":
    main()
