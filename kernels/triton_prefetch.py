"""L2 prefetch: read a weight through the L2 cache (evict-last) ahead of the GEMM that needs it.

A decode step of a few rows reads every weight once and is bound by HBM, yet the HBM idles while the
latency-bound kernels between two GEMMs run (rotary embedding and attention take ~10 us a layer at
batch 1). Launched on a side stream beside them, this kernel streams the next GEMM's weight into L2,
so the GEMM finds much of it there. It computes nothing anyone reads: each program stores the
maximum of what it read to ``sink`` only so that the loads cannot be optimised away (and to test
that the programs together cover the weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _l2_prefetch_kernel(src_ptr, sink_ptr, ctas_ptr, numel, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    active = tl.load(ctas_ptr)  # why a device scalar: the rate can change without re-capturing graphs
    if pid >= active:
        return
    offs = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for start in range(pid * BLOCK, numel, active * BLOCK):
        x = tl.load(src_ptr + start + offs, mask=start + offs < numel, other=float("-inf"), eviction_policy="evict_last")
        top = tl.maximum(top, x.to(tl.float32))
    tl.store(sink_ptr + pid, tl.max(top, 0))


def l2_prefetch(weight: torch.Tensor, ctas: torch.Tensor, sink: torch.Tensor, max_bytes: int) -> None:
    """Read the first ``max_bytes`` of contiguous ``weight`` with ``ctas[0]`` programs (0: none) of a
    grid of ``sink.numel()``; program p writes the maximum it read to ``sink[p]``."""
    assert weight.is_contiguous() and ctas.dtype == torch.int32 and sink.dtype == torch.float32
    numel = min(weight.numel(), max_bytes // weight.element_size())
    if numel > 0:
        _l2_prefetch_kernel[(sink.numel(),)](weight, sink, ctas, numel, BLOCK=4096, num_warps=4, num_stages=4)
