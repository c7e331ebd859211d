"""Does decode attention run beside cuBLAS products on a second stream? (The premise of nano-batching:
two batches in flight in a step, one's memory-bound attention under the other's compute-bound GEMMs.)

One Llama-3-8B layer's MLP products (gate_up, down; bf16 ``F.linear``) on the main stream and one
layer's decode attention (``paged_decode_attention``, 32 / 8 heads of 128, blocks of 64) on a side
stream, at four shapes: a mixed step's 8,192 rows beside 256 decode rows, and decode steps of 382, 256
and 128 rows. Prints ms of each alone, of both on one stream, and of both on two streams, with and
without an SM carveout for the products (``torch._C._set_sm_carveout_experimental``, which makes
cuBLAS leave SMs free). Two streams that overlap take less than one stream.

    PYTHONPATH=$PWD python3 bench/stream_overlap.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels_bench import make_batch

from mii_server.kernels import triton_attention

# (name, product rows, decode sequences, their context, SM carveouts to try beside none)
CASES = [
    ("mixed step: 8,192-row products | 256 decode rows at 1,400", 8192, 256, 1400, (16, 32)),
    ("wide decode: 382 rows at 1,400", 382, 382, 1400, (32, 66)),
    ("decode: 256 rows at 640", 256, 256, 640, (32, 66)),
    ("a nano-batch half: 128 rows at 640", 128, 128, 640, (32, 66)),
]


def timed(fn, reps: int = 20) -> float:
    """ms per call, CUDA events around ``reps`` calls after one warm call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def case(name: str, rows: int, seqs: int, ctx: int, carveouts: tuple[int, ...]) -> None:
    dev, dtype = "cuda", torch.bfloat16
    x = torch.randn(rows, 4096, device=dev, dtype=dtype)
    h = torch.randn(rows, 14336, device=dev, dtype=dtype)
    gate_up = torch.randn(28672, 4096, device=dev, dtype=dtype) * 0.02
    down = torch.randn(4096, 14336, device=dev, dtype=dtype) * 0.02
    q, k_cache, v_cache, meta = make_batch([(1, ctx)] * seqs, 32, 8, 128, 64, dtype)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()

    def products() -> None:
        F.linear(x, gate_up)
        F.linear(h, down)

    def attention() -> None:
        triton_attention.paged_decode_attention(q, k_cache, v_cache, meta, 128**-0.5, out=out)

    def one_stream() -> None:
        attention()
        products()

    def two_streams() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            attention()
        products()
        main.wait_stream(side)

    alone = timed(attention)
    print(f"{name}: attention alone {alone:.3f} ms")
    for carveout in (None, *carveouts):
        torch._C._set_sm_carveout_experimental(carveout)
        one, two = timed(one_stream), timed(two_streams)
        print(f"  SM carveout {carveout or 0:>2}: products alone {timed(products):.3f}, one stream {one:.3f}, "
              f"two streams {two:.3f} ({two / one:.3f} of one)", flush=True)  # fmt: skip
    torch._C._set_sm_carveout_experimental(None)


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    print(torch.cuda.get_device_name())
    for c in CASES:
        case(*c)


if __name__ == "__main__":
    main()
