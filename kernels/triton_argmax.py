"""Row-wise argmax spread over the GPU: what the sampler's greedy rows (and its exponential race) take.

torch's ``argmax(dim=-1)`` gives each row to one thread block, so at batch 1 a 128k-entry vocabulary
is scanned by one SM (27 us a step on an H200, docs/BENCHMARKS.md). Here ``_chunk_argmax_kernel``
gives each (row, chunk of ``BLOCK`` columns) its own program, which writes the chunk's best key and
column; ``_row_argmax_kernel`` then picks, per row, the first chunk holding the row's best key.

Semantics are torch's: the first column of the maximum wins; NaN counts as greater than every
number (the first NaN wins); -0.0 equals 0.0. Each value becomes an int32 key whose signed order is
the float order (negative floats have their 31 low bits flipped), NaN the largest key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # columns per program: a 128k vocabulary is 63 programs per row
_KEY_MIN = tl.constexpr(-(2**31))  # below every float's key: columns past the vocabulary
_KEY_NAN = tl.constexpr(2**31 - 1)  # above every number's key


@triton.jit
def _chunk_argmax_kernel(x_ptr, stride_x, keys_ptr, cols_ptr, V, CHUNKS, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> 0.0: equal values must have equal keys
    bits = x.to(tl.int32, bitcast=True)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, _KEY_NAN, keys)  # NaN: all exponent bits, a mantissa
    keys = tl.where(cols < V, keys, _KEY_MIN)
    best, at = tl.max(keys, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(keys_ptr + row * CHUNKS + chunk, best)
    tl.store(cols_ptr + row * CHUNKS + chunk, chunk * BLOCK + at)


@triton.jit
def _row_argmax_kernel(keys_ptr, cols_ptr, out_ptr, CHUNKS, CHUNKS_POW2: tl.constexpr):
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_POW2)
    keys = tl.load(keys_ptr + row * CHUNKS + chunks, mask=chunks < CHUNKS, other=_KEY_MIN)
    _, first = tl.max(keys, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(cols_ptr + row * CHUNKS + first).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [S, V] float -> int64 [S], the first column of each row's maximum (as ``x.argmax(-1)``)."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[0] == 0 or x.shape[1] >= 2**31 - BLOCK:
        return x.argmax(dim=-1)
    rows, vocab = x.shape
    chunks = triton.cdiv(vocab, BLOCK)
    keys = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    cols = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _chunk_argmax_kernel[(rows, chunks)](x, x.stride(0), keys, cols, vocab, chunks, BLOCK=BLOCK, num_warps=4)
    _row_argmax_kernel[(rows,)](keys, cols, out, chunks, CHUNKS_POW2=triton.next_power_of_2(chunks), num_warps=1)
    return out
