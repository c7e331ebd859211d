"""Step 5 of init_inference: CUDA graphs of the kernel-injected decoder's one-token step.

``generate``'s decode steps all have the same shapes for a given batch size, so the first decode step
at batch size B captures ``InjectedDecoder.decode_step`` over the shared pool's first B rows into a
graph (one memory pool for all sizes), and every later one copies its ids, positions and mask into
the graph's static inputs and replays it: one launch instead of ~10 per layer. Prefill steps, and
steps over a one-off pool, run eagerly. The graph reads and advances the pool's row lengths on the
device, and its decode attention is split for the pool's whole capacity, so no value baked in at
capture goes stale. A reallocated pool drops the graphs (they point at the old storage).

Warm-up and capture run with an all-padding mask: nothing is written to the cache and no length moves.
Under tensor parallelism the all-reduces are captured too (NCCL supports capture); every rank captures
at the same step because every rank runs the same ``generate``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import InvalidRequest
from ..kernels import get_ops, reference
from ..models.parallel import TensorParallelGroup
from .kv_cache import KVPool

log = logging.getLogger(__name__)

DecodeStep = Callable[[KVPool, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_graphs_possible(device: torch.device, injected: bool, tp: TensorParallelGroup) -> None:
    """Raise ``InvalidRequest`` saying why ``enable_cuda_graph`` cannot work here, if it cannot."""
    if device.type != "cuda":
        raise InvalidRequest(f"enable_cuda_graph needs the model on a CUDA device, not {device}")
    if not injected:
        raise InvalidRequest(
            "enable_cuda_graph needs replace_with_kernel_inject=True on a family with our kernels: "
            "transformers' own KV cache grows by concatenation, which a CUDA graph cannot replay"
        )
    if get_ops(device) is reference:
        raise InvalidRequest(
            "enable_cuda_graph needs the Triton kernels (the reference attention reads lengths on the host)"
        )
    if tp.size > 1:
        import torch.distributed as dist

        backend = dist.get_backend()
        if backend != "nccl":
            raise InvalidRequest(
                f"enable_cuda_graph with tensor parallelism needs NCCL, whose collectives can be captured; "
                f"this process group uses {backend}"
            )


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # int64 [B] static inputs, copied into before each replay
    positions: torch.Tensor  # int64 [B]
    mask: torch.Tensor  # int32 [B]
    out: torch.Tensor  # [B, hidden], written by each replay


class DecodeGraphs:
    """Captured one-token steps of one decoder, per batch size, over its shared pool."""

    def __init__(self, step: DecodeStep, device: torch.device) -> None:
        self.step = step
        self.device = device
        self.mempool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, _Graph] = {}
        self._pool: KVPool | None = None

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes captured so far, ascending."""
        return sorted(self._graphs)

    def reset(self) -> None:
        """Forget every graph (the pool they read was replaced)."""
        self._graphs.clear()
        self._pool = None
        # why a new memory pool: the caching allocator frees a graph pool once its last graph is gone,
        # and capturing into the freed pool's handle trips its internal assert (use_count > 0)
        self.mempool = torch.cuda.graph_pool_handle()

    def run(
        self, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The step's hidden states [B, hidden] for these inputs, replayed (captured on first use)."""
        if pool is not self._pool:
            self.reset()
            self._pool = pool
        batch = ids.shape[0]
        entry = self._graphs.get(batch)
        if entry is None:
            entry = self._graphs[batch] = self._capture(pool, batch)
        entry.ids.copy_(ids)
        entry.positions.copy_(positions)
        entry.mask.copy_(mask)
        entry.graph.replay()
        # why clone: the next replay overwrites the output, and the caller may hold it longer
        return entry.out.clone()

    def _capture(self, pool: KVPool, batch: int) -> _Graph:
        with torch.inference_mode(False):  # static buffers are written in place on every replay
            ids = torch.zeros(batch, dtype=torch.int64, device=self.device)
            positions = torch.zeros(batch, dtype=torch.int64, device=self.device)
            mask = torch.zeros(batch, dtype=torch.int32, device=self.device)  # all padding: writes nothing
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():  # warm up off-graph: Triton compiles, cuBLAS sizes
            self.step(pool, ids, positions, mask)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # why thread_local: under TP the NCCL watchdog thread queries events while this thread captures
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"), torch.no_grad():
            out = self.step(pool, ids, positions, mask)
        log.info("captured the injected decode step for batch %d as a CUDA graph", batch)
        return _Graph(graph=graph, ids=ids, positions=positions, mask=mask, out=out)
