"""Tokenising a call's prompts one by one against in one batch (``GenerationLoop.prepare_many``).

A fast tokenizer encodes a batch on every core; one prompt at a time it takes one. This times both
ways on the same prompts, for the demo model's BPE tokenizer and the benchmarks' word-level one
(``bench/checkpoints.py``), checks that they give the same ids, and prints the ratio. CPU only.

    python3 bench/tokenize_batch_bench.py --prompts 256 --tokens 512
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import LLAMA3_8B, word_level_tokenizer, word_text


def best_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compare(name: str, tok, prompts: list[str], repeat: int) -> None:
    one = best_seconds(lambda: [tok.encode(p) for p in prompts], repeat)
    batch = best_seconds(lambda: tok(prompts), repeat)
    ids = tok(prompts)["input_ids"]
    assert ids == [tok.encode(p) for p in prompts], "a batch must give what one by one gives"
    tokens = sum(map(len, ids)) / len(ids)
    print(f"{name}: {tokens:.0f} tokens a prompt; one by one {one:.3f} s, one batch {batch:.3f} s: {one / batch:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512, help="about this many tokens a prompt")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many timings each way")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    rng = random.Random(0)
    demo = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "mii_server" / "demo_weights")
    words = word_level_tokenizer(LLAMA3_8B["vocab_size"])
    cases = {
        "demo BPE": (demo, [" ".join(f"w{rng.randrange(10**6)}" for _ in range(args.tokens // 5))
                            for _ in range(args.prompts)]),
        "word-level": (words, [word_text([rng.randrange(3, LLAMA3_8B["vocab_size"]) for _ in range(args.tokens)])
                               for _ in range(args.prompts)]),
    }  # fmt: skip
    print(f"{os.cpu_count()} cores, {args.prompts} prompts")
    for name, (tok, prompts) in cases.items():
        compare(name, tok, prompts, args.repeat)


if __name__ == "__main__":
    main()
