"""HostCopy: device tensors on their way to the host, queued behind the work that computes them."""

from __future__ import annotations

from typing import Any

import torch


class HostCopy:
    """The copies are queued on the current stream (into pinned memory on CUDA) and waited for
    only when the values are needed, so the host can queue the next forward meanwhile."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        self._lists: list[Any] | None = None
        if tensors and tensors[0].device.type == "cuda":
            self._host = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                self._host.append(host)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = list(tensors)

    def wait(self) -> list[Any]:
        """Each tensor as (nested) host lists, in the order given (read once, then kept)."""
        if self._lists is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._lists = [t.tolist() for t in self._host]
        return self._lists
