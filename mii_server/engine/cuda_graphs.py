"""DecodeGraphs: CUDA graphs of decode-only forwards, captured for a ladder of batch sizes at start-up.

A decode-only step (one new token per sequence) is padded up to a rung of the ladder and replayed:
one host-to-device copy of the packed batch into the rung's static input buffer, one graph launch.
Padded tokens carry cache slot -1 (the KV append skips them) and padded sequences own no tokens, so
the real rows' logits equal an eager forward's.

The rung is the smallest that holds the batch, unless a larger one replays clearly faster: each
graph is timed once after capture (``fastest_rungs``), because a library GEMM's speed is not
monotone in its rows (cuBLAS's bf16 gate_up of Llama-3-8B took 296 us at 448 rows and 162 us at 512
on an H100).

No global state: the metadata the captured kernels read is a set of views of each rung's static
buffer, passed to the model explicitly at capture time like any other batch's. The decode attention
chooses its split count from ``max_context_len``; graphs are captured with the longest context the
cache allows, so one fixed split policy per rung serves every later context length.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.parallel import TensorParallelGroup
from .kv_cache import BlockedKVCache
from .ragged_batch import BatchLayout, HostStaging, RaggedBatch, pack_batch, with_fed_back
from .state_manager import SequenceDescriptor

log = logging.getLogger(__name__)

# Rungs: fine steps where batches are small (weight-bound steps cost the same at 9 or 16 rows, but
# padding 1 to 16 would waste the attention and sampling), coarser above.
_LADDER = [1, 2, 4, 8, *range(16, 257, 16), *range(320, 1025, 64)]


def graph_batch_sizes(max_seqs: int, cap: int = 512) -> list[int]:
    """The rungs to capture for batches of up to ``min(max_seqs, cap)`` sequences, ascending.

    The limit itself is always a rung, so every decode batch the engine accepts (up to the cap)
    finds one.
    """
    limit = min(max_seqs, cap)
    if limit < 1:
        return []
    sizes = [n for n in _LADDER if n < limit]
    return [*sizes, limit]


def pick_rung(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest rung holding ``num_seqs`` sequences, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


# a larger rung replaces a smaller one only when it replays at least this much faster (timing noise)
REROUTE_MIN_GAIN = 0.05


def fastest_rungs(replay_ms: dict[int, float]) -> dict[int, int]:
    """Rung -> the rung its batches replay: the smallest rung at or above it whose replay time is
    within ``REROUTE_MIN_GAIN`` of the fastest of those (most rungs map to themselves)."""
    sizes = sorted(replay_ms)
    routes = {}
    for i, rung in enumerate(sizes):
        larger = sizes[i:]
        best = min(replay_ms[q] for q in larger)
        routes[rung] = next(q for q in larger if replay_ms[q] * (1 - REROUTE_MIN_GAIN) <= best)
    return routes


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # uint8 device buffer the graph's metadata views point into
    logits: torch.Tensor  # float32 [rung, vocab], written by each replay


class DecodeGraphs:
    """Captured decode forwards of one model over one KV cache; ``run`` replays the right rung."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: BlockedKVCache,
        batch_sizes: Sequence[int],
        max_context_len: int,
        staging: HostStaging,
        fed_back: torch.Tensor,
    ) -> None:
        """Capture one graph per batch size (largest first, sharing one memory pool).

        ``max_context_len``: the longest context a replayed sequence may have; it fixes the block
        table width and the decode attention's split policy. ``fed_back``: the engine's buffer of
        fed-back ids, which placeholder tokens read inside the graph.
        """
        self.fed_back = fed_back
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.batch_sizes = sorted(batch_sizes)
        self.max_context_len = max_context_len
        self.table_width = -(-max_context_len // self.block_size)
        self.staging = staging
        device = kv_cache.keys[0].device
        self._graphs: dict[int, _Graph] = {}
        pool = torch.cuda.graph_pool_handle()
        # why one side stream: warm-up blocks are cached per stream, so every rung reuses the first's
        warmup = torch.cuda.Stream(device)
        before = torch.cuda.memory_reserved(device)
        with torch.inference_mode():
            for n in reversed(self.batch_sizes):
                self._graphs[n] = self._capture(model, n, device, pool, warmup)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # hand the warm-up blocks back; the graphs keep only their pool
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        log.info(
            "captured %d decode CUDA graphs (batch %d..%d, context <= %d) in %.0f MiB",
            len(self._graphs), self.batch_sizes[0], self.batch_sizes[-1], max_context_len,
            self.pool_bytes / 2**20,
        )  # fmt: skip
        self.replay_ms = self._time_replays(device, model.tp)
        self.routes = fastest_rungs(self.replay_ms)
        for rung, used in self.routes.items():
            if used != rung:
                log.info(
                    "decode batches of the %d-row rung replay the %d-row graph (%.2f ms against %.2f)",
                    rung, used, self.replay_ms[used], self.replay_ms[rung],
                )  # fmt: skip

    def _capture(
        self, model: torch.nn.Module, n: int, device: torch.device, pool: object, stream: torch.cuda.Stream
    ) -> _Graph:
        # an all-padding batch: no sequence owns a token, every slot is -1, so nothing is written
        empty = pack_batch([], [], self.block_size, num_seqs=n, table_width=self.table_width)
        inputs = torch.from_numpy(empty.data).to(device)
        batch: RaggedBatch = empty.layout.views(inputs, max_q_len=1, max_context_len=self.max_context_len)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # why: warm up (compile Triton, size cuBLAS workspaces) off-graph
            model(with_fed_back(batch.input_ids, self.fed_back), batch.meta, self.kv_cache)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # why thread_local: under tensor parallelism the NCCL watchdog thread queries its events while
        # this thread captures the collectives; the global mode would fail the capture on that
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = model(with_fed_back(batch.input_ids, self.fed_back), batch.meta, self.kv_cache)
        return _Graph(graph=graph, inputs=inputs, logits=logits)

    def _time_replays(
        self, device: torch.device, tp: TensorParallelGroup, replays: int = 3
    ) -> dict[int, float]:
        """ms of each rung's replay on its all-padding capture inputs (nothing is read or written
        but the weights and activations: the part of a step its rung decides), the least of
        ``replays``. Under tensor parallelism the ranks' times are summed, so every rank routes alike
        (their graphs' collectives must match)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = torch.zeros(len(self.batch_sizes), dtype=torch.float64)
        for i, n in enumerate(self.batch_sizes):
            graph = self._graphs[n].graph
            graph.replay()  # warm: the first replay uploads the graph
            best = float("inf")
            for _ in range(replays):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            times[i] = best
        if tp.size > 1:
            times = tp.all_reduce(times.to(device)).cpu()
        return dict(zip(self.batch_sizes, times.tolist(), strict=True))

    def fits(self, sequences: Sequence[SequenceDescriptor], tokens: Sequence[Sequence[int]]) -> bool:
        """Whether this batch is decode-only and small enough for a captured graph."""
        if not sequences or len(sequences) > self.batch_sizes[-1]:
            return False
        width = self.table_width
        return all(len(t) == 1 for t in tokens) and all(len(s.blocks) <= width for s in sequences)

    def run(self, sequences: Sequence[SequenceDescriptor], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Replay the forward of a batch that ``fits``; returns fresh float32 logits [S, vocab]."""
        rung = pick_rung(self.batch_sizes, len(sequences))
        assert rung is not None
        rung = self.routes[rung]
        entry = self._graphs[rung]
        packed = pack_batch(sequences, tokens, self.block_size, num_seqs=rung, table_width=self.table_width)
        self.staging.upload(packed, out=entry.inputs)
        entry.graph.replay()
        # why clone: the next replay overwrites the graph's output, and callers may hold logits longer
        return entry.logits[: len(sequences)].clone()


def forward_peak_bytes(
    model: torch.nn.Module, kv_cache: BlockedKVCache, num_tokens: int, num_seqs: int
) -> int:
    """Peak device memory one eager forward of ``num_tokens`` tokens in ``num_seqs`` sequences takes
    (activations and logits), measured on an all-padding batch over ``kv_cache`` (a scratch cache of
    one block does: padding reads and writes nothing)."""
    device = kv_cache.keys[0].device
    layout = BatchLayout(num_tokens, num_seqs, 1)
    inputs = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    batch = layout.views(inputs, max_q_len=2 if num_tokens > num_seqs else 1, max_context_len=1)
    batch.meta.slot_mapping.fill_(-1)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model(batch.input_ids, batch.meta, kv_cache)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base
