"""Zeroed device buffers for kernels whose programs meet through atomics.

A kernel whose programs each do part of a job and count their arrivals (the last to arrive finishes
it: merges the decode attention's splits) needs buffers that are zero
when it starts. Allocating and zeroing them per launch would cost a launch; instead each (device,
purpose) has one buffer, allocated once and never freed (captured CUDA graphs keep its address),
and every launch returns the entries it used to zero before it ends. Launches of one purpose on a
device must therefore not overlap, as the engine's single compute stream guarantees.
"""

from __future__ import annotations

import torch

CAPACITY = 1 << 16  # entries of one buffer: a launch that needs more takes its kernel's other path
_buffers: dict[tuple[torch.device, str], torch.Tensor] = {}


def zeroed_counters(device: torch.device, purpose: str, count: int) -> torch.Tensor | None:
    """The device's zeroed int32 buffer for ``purpose`` (at least ``count`` entries), or None where
    it cannot serve: more than ``CAPACITY`` entries, or first needed inside a CUDA graph capture,
    where a new buffer would belong to the graph's memory pool."""
    key = (device, purpose)
    if key not in _buffers:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _buffers[key] = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    return _buffers[key] if count <= CAPACITY else None
