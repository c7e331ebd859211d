"""Host cost of one batching-loop step, with the model replaced by random logits (CPU, no GPU needed).

On a GPU the loop is synchronous: whatever the host spends per step (scheduling, packing, sampling,
detokenising, stop checks) adds to the GPU's step time. This measures that host time at a given
number of running requests, for streamed requests (text decoded token by token) against whole ones
(text decoded once at the end) in the same run, and whole ones again with the prefix cache's block
accounting (hashing and registering every filled block).

    python bench/host_loop_bench.py --requests 256 --steps 64
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from mii_server.batching.executor import LocalExecutor
from mii_server.batching.loop import GenerationLoop
from mii_server.demo_model import train_tokenizer
from mii_server.engine import BlockedAllocator, BlockedKVCache, InferenceEngine, PrefixCache, StateManager
from mii_server.generation.params import GenerateParams


class RandomLogits(torch.nn.Module):
    """Stands in for a model: one row of random logits per sequence, no compute."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # gives the engine a device

    def forward(self, input_ids: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        return torch.randn(meta.num_seqs, self.vocab)


def make_loop(
    tokenizer, requests: int, prompt_len: int, gen_len: int, prefix_caching: bool = False
) -> GenerationLoop:
    block_size = 64
    blocks = requests * (-(-(prompt_len + gen_len) // block_size))
    allocator = PrefixCache(blocks) if prefix_caching else BlockedAllocator(blocks)
    engine = InferenceEngine(
        RandomLogits(len(tokenizer)),
        BlockedKVCache(1, 1, block_size, 1, 1, torch.float32, torch.device("cpu")),  # never written
        StateManager(allocator, block_size, requests),
        max_ragged_batch_size=max(4096, requests),
        max_ragged_sequence_count=requests,
    )
    return GenerationLoop(
        LocalExecutor(engine), tokenizer, frozenset(), context_length=8192, default_max_length=8192,
        max_batch_tokens=max(4096, requests), max_batch_sequences=requests, max_tracked_sequences=requests,
    )  # fmt: skip


def decode_step_ms(
    tokenizer, args: argparse.Namespace, stream: bool, prefix_caching: bool = False
) -> float:
    loop = make_loop(tokenizer, args.requests, args.prompt_len, args.steps + 8, prefix_caching)
    params = GenerateParams(max_new_tokens=args.steps + 8, do_sample=False, ignore_eos=True)
    for i in range(args.requests):  # distinct prompts: no request reuses another's blocks
        prompt = [4 + (i * 7 + j) % 300 for j in range(args.prompt_len)]
        loop.submit(prompt, params, lambda update: None, stream)
    while any(r.num_pending_tokens > 1 for r in loop.scheduler.running) or loop.scheduler.waiting:
        loop.step()  # prefill until every request decodes
    start = time.perf_counter()
    for _ in range(args.steps):
        loop.step()
    return 1000 * (time.perf_counter() - start) / args.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = train_tokenizer(Path(tempfile.mkdtemp()))
    streamed = decode_step_ms(tokenizer, args, stream=True)
    whole = decode_step_ms(tokenizer, args, stream=False)
    print(f"host time per decode step, {args.requests} running requests (model stubbed, 1 thread):")
    print(f"  streamed (decode each token): {streamed:7.2f} ms")
    print(f"  whole (decode once at end):   {whole:7.2f} ms   ratio streamed/whole {streamed / whole:.2f}x")
    cached = decode_step_ms(tokenizer, args, stream=False, prefix_caching=True)
    print(f"  whole, prefix caching on:     {cached:7.2f} ms   ratio on/off {cached / whole:.2f}x")


if __name__ == "__main__":
    main()
