"""transformers ``generate``, plain vs wrapped by ``mii_server.init_inference``, in one run (issue 15).

A Llama-3-8B-shaped model (the shape of ``bench/checkpoints.py``) with random bf16 weights is built
on the GPU by transformers itself (its own init, std 0.02; no checkpoint is written). Then, for
batch 1 and batch 64 (prompts of ``--prompt`` random tokens, greedy, EOS ignored):

1. plain: the transformers model's own ``generate`` (SDPA attention, its dynamic cache);
2. wrapped: the same model object after ``init_inference(model, replace_with_kernel_inject=True,
   enable_cuda_graph=True)`` (our decoder layers and KV cache, decode steps replayed as CUDA graphs),
   and, at batch 1, the same with the graphs switched off (kernel injection alone).

Decode speed is measured from two generation lengths (``--short`` and ``--long`` new tokens), so
the prefill cancels: ms per decode step = (t_long - t_short) / (long - short). Each figure is
printed as a JSON row beside the batch-1 weight-read roofline, and the wrapped/plain ratio (target:
>= 4x at batch 1). Greedy agreement of wrapped vs plain tokens is reported (random bf16 weights have
near-tied logits, so it is a lower bound of what real weights give).

    PYTHONPATH=. python3 bench/init_inference_bench.py [--json out.json]      # one H200, ~3 minutes
    PYTHONPATH=. python3 bench/init_inference_bench.py --tiny                 # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import LLAMA3_8B

import mii_server

HBM_BYTES_PER_S = 4.24e12  # measured device-to-device copy rate on the H200 (docs/BENCHMARKS.md)
TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RESULTS: list[dict[str, Any]] = []


def report(name: str, **fields: Any) -> None:
    row = {"bench": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()}}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build_model(shape: dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32
        )
    return model.to(DEVICE).eval()


def timed_generate(model: Any, ids: torch.Tensor, new: int) -> tuple[float, torch.Tensor]:
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=2,
        )  # fmt: skip
    sync()
    return time.perf_counter() - start, out[:, ids.shape[1] :]


def decode_ms(model: Any, ids: torch.Tensor, short: int, long: int) -> tuple[float, torch.Tensor]:
    """ms per decode step (prefill cancelled by two lengths) and the long run's new tokens."""
    timed_generate(model, ids, 2)  # warm-up: kernels compiled, caches sized, graphs captured
    t_short, _ = timed_generate(model, ids, short)
    t_long, tokens = timed_generate(model, ids, long)
    return (t_long - t_short) / (long - short) * 1e3, tokens


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of tokens in the common prefix of each row (greedy paths part for good at a difference)."""
    same = 0
    for x, y in zip(a.tolist(), b.tolist()):
        same += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
    return same / a.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke test)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--short", type=int, default=16, help="new tokens of the shorter run")
    parser.add_argument("--long", type=int, default=80, help="new tokens of the longer run")
    parser.add_argument("--json", help="write every result row to this file")
    args = parser.parse_args()
    shape = TINY if args.tiny else LLAMA3_8B
    start = time.perf_counter()
    model = build_model(shape)
    # the batch-1 decode floor: every weight but the embedding read once a step
    matrices = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    read = matrices - shape["vocab_size"] * shape["hidden_size"]
    floor_ms = read * model.dtype.itemsize / HBM_BYTES_PER_S * 1e3
    report("model_built", seconds=time.perf_counter() - start, device=DEVICE, dtype=str(model.dtype),
           layers=shape["num_hidden_layers"], transformers=__import__("transformers").__version__)  # fmt: skip
    rng = torch.Generator().manual_seed(0)
    prompts = {
        b: torch.randint(3, shape["vocab_size"] - 1, (b, args.prompt), generator=rng).to(DEVICE)
        for b in args.batches
    }

    plain: dict[int, tuple[float, torch.Tensor]] = {}
    for b in args.batches:
        plain[b] = decode_ms(model, prompts[b], args.short, args.long)
        report(
            "plain",
            batch=b,
            ms_per_step=plain[b][0],
            tokens_per_s=b * 1e3 / plain[b][0],
            roofline_ms=floor_ms,
        )

    start = time.perf_counter()
    graphs = DEVICE == "cuda"
    engine = mii_server.init_inference(model, replace_with_kernel_inject=True, enable_cuda_graph=graphs,
                                       max_out_tokens=args.prompt + args.long)  # fmt: skip
    report("wrapped_init", seconds=time.perf_counter() - start, cuda_graphs=graphs)
    for b in args.batches:
        ms, tokens = decode_ms(engine, prompts[b], args.short, args.long)
        report("wrapped", batch=b, ms_per_step=ms, tokens_per_s=b * 1e3 / ms, roofline_ms=floor_ms,
               speedup=plain[b][0] / ms, target=4.0 if b == 1 else None,
               greedy_agreement=agreement(tokens, plain[b][1]))  # fmt: skip
    if graphs and 1 in args.batches:
        saved = engine.injected.graphs
        engine.injected.graphs = None  # kernel injection alone: the same decoder, every step eager
        ms, _ = decode_ms(engine, prompts[1], args.short, args.long)
        engine.injected.graphs = saved
        report("wrapped_no_graphs", batch=1, ms_per_step=ms, speedup=plain[1][0] / ms)
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
