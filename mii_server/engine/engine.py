"""InferenceEngine: put / query / can_schedule / flush over a model and a blocked KV cache.

No scheduling policy and no sampling live here (DeepSpeed inference v2 semantics): the caller
decides what runs; the engine runs it, or says why it cannot.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from ..errors import CapacityExceeded
from .cuda_graphs import DecodeGraphs, graph_batch_sizes
from .kv_cache import BlockedKVCache
from .prefix_cache import BlockBudget, PrefixCache
from .ragged_batch import HostStaging, RaggedBatch, with_fed_back
from .state_manager import StateManager


class SchedulingResult(enum.Enum):
    """Answer of ``can_schedule``: Success, or the first limit the batch would break."""

    Success = 0
    EngineSequenceLimitExceeded = 1  # more live sequences than max_tracked_sequences
    BatchSequenceLimitExceeded = 2  # more sequences in one forward than max_ragged_sequence_count
    BatchTokenLimitExceeded = 3  # more tokens in one forward than max_ragged_batch_size
    KVCacheLimitExceeded = 4  # not enough free KV blocks


class InferenceEngine:
    """Runs ragged forward passes of ``model`` over ``kv_cache``, tracking sequences by uid."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: BlockedKVCache,
        state_manager: StateManager,
        max_ragged_batch_size: int,
        max_ragged_sequence_count: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.state = state_manager
        self.max_ragged_batch_size = max_ragged_batch_size
        self.max_ragged_sequence_count = max_ragged_sequence_count
        self.device = next(model.parameters()).device
        self._staging = HostStaging(self.device)  # one reusable (pinned) upload buffer
        self._graphs: DecodeGraphs | None = None  # decode-only CUDA graphs, once captured
        # the ids the caller sampled from the last put's logits, for the next put (see feed_back)
        self._fed_back = torch.zeros(max_ragged_sequence_count, dtype=torch.int64, device=self.device)
        self.use_cuda_graphs = True  # False runs every step eagerly even when graphs were captured
        # blocks shared by content (a StateManager over a PrefixCache), else None
        allocator = state_manager.allocator
        self.prefix_cache = allocator if isinstance(allocator, PrefixCache) else None

    def capture_cuda_graphs(self, max_context_len: int, max_batch: int = 512) -> DecodeGraphs:
        """Capture decode-only forwards for a ladder of batch sizes (CUDA only); later ``put``s of
        decode-only batches with contexts up to ``max_context_len`` replay them."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        sizes = graph_batch_sizes(min(self.max_ragged_sequence_count, self.max_ragged_batch_size), max_batch)
        self._graphs = DecodeGraphs(
            self.model, self.kv_cache, sizes, max_context_len, self._staging, self._fed_back
        )
        return self._graphs

    @property
    def cuda_graphs(self) -> DecodeGraphs | None:
        return self._graphs

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def free_blocks(self) -> int:
        return self.state.allocator.free_blocks

    @property
    def total_blocks(self) -> int:
        return self.state.allocator.num_blocks

    @property
    def cached_blocks(self) -> int:
        """Blocks whose content a new sequence may reuse (0 without prefix caching)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.cached_blocks

    def block_budget(self) -> BlockBudget:
        """A fresh count of allocatable blocks for scheduling one step (see ``BlockBudget``)."""
        state = self.state
        empty: list[int] = []
        return BlockBudget(
            free=state.allocator.free_blocks,
            refcount=state.allocator.refcount,
            blocks_of=lambda uid: seq.blocks if (seq := state.get(uid)) is not None else empty,
            match=(lambda hashes: []) if self.prefix_cache is None else self.prefix_cache.match,
        )

    def reuse_prefix(self, uid: int, hashes: Sequence[bytes]) -> None:
        """Start the new sequence ``uid`` from the cached blocks of ``hashes`` (see
        ``prefix_cache.chain_hashes``): its first ``len(hashes) * block_size`` tokens are seen.
        Every hash must be cached (the scheduler checked, on this rank's twin state)."""
        if self.prefix_cache is None:
            raise ValueError("prefix reuse needs an engine with prefix caching")
        if len(self.prefix_cache.match(hashes)) != len(hashes):
            raise ValueError(f"sequence {uid} asks for {len(hashes)} cached blocks; not all are cached")
        self.state.adopt(uid, self.prefix_cache.acquire(hashes))

    def register_blocks(self, uid: int, first: int, hashes: Sequence[bytes]) -> None:
        """Blocks ``first, first + 1, ...`` of ``uid`` are full and hold the content of ``hashes``:
        make them reusable (a no-op without prefix caching; content cached already stays where it is)."""
        if self.prefix_cache is None:
            return
        blocks = self.state.get(uid).blocks  # type: ignore[union-attr]
        for block, block_hash in zip(blocks[first : first + len(hashes)], hashes, strict=True):
            self.prefix_cache.register(block, block_hash)

    def blocks_held(self, uid: int) -> int:
        seq = self.state.get(uid)
        return 0 if seq is None else len(seq.blocks)

    def seen_tokens(self, uid: int) -> int:
        seq = self.state.get(uid)
        return 0 if seq is None else seq.seen_tokens

    def query(self, uid: int, max_tokens: int, max_blocks: int) -> tuple[int, int]:
        """How many of ``max_tokens`` new tokens of ``uid`` fit in ``max_blocks`` more blocks.

        Returns (tokens, blocks those tokens need).
        """
        seq = self.state.get(uid)
        seen, have = (0, 0) if seq is None else (seq.seen_tokens, len(seq.blocks))
        room = (have + max_blocks) * self.block_size - seen
        tokens = max(0, min(max_tokens, room))
        return tokens, self.state.blocks_needed(uid, tokens)

    def can_schedule(self, uids: Sequence[int], lengths: Sequence[int]) -> SchedulingResult:
        """Whether ``put`` of ``lengths[i]`` new tokens for each ``uids[i]`` would succeed."""
        new_seqs = sum(1 for uid in uids if uid not in self.state)
        if len(self.state) + new_seqs > self.state.max_tracked_sequences:
            return SchedulingResult.EngineSequenceLimitExceeded
        if len(uids) > self.max_ragged_sequence_count:
            return SchedulingResult.BatchSequenceLimitExceeded
        if sum(lengths) > self.max_ragged_batch_size:
            return SchedulingResult.BatchTokenLimitExceeded
        blocks = sum(self.state.blocks_needed(uid, n) for uid, n in zip(uids, lengths))
        if blocks > self.free_blocks:
            return SchedulingResult.KVCacheLimitExceeded
        return SchedulingResult.Success

    def feed_back(self, ids: torch.Tensor) -> None:
        """Keep ``ids`` (int64 [n] on the device, e.g. tokens sampled from the last ``put``'s logits)
        for the next ``put``, whose token lists may name ``ids[i]`` by the placeholder ``-1 - i``:
        the host can queue the next forward before it has read the sampled ids back."""
        if ids.numel() > self._fed_back.numel():
            raise ValueError(f"can feed back at most {self._fed_back.numel()} ids, got {ids.numel()}")
        self._fed_back[: ids.numel()].copy_(ids)

    def fed_back_ids(self, n: int) -> torch.Tensor:
        """The first ``n`` fed-back ids, as a view a caller may write into (a tensor-parallel
        follower receives rank 0's there; see ``tensor_parallel.executor``)."""
        if n > self._fed_back.numel():
            raise ValueError(f"at most {self._fed_back.numel()} ids are fed back, not {n}")
        return self._fed_back[:n]

    def put(
        self, uids: Sequence[int], tokens: Sequence[Sequence[int]], full_logits: Sequence[int] = ()
    ) -> torch.Tensor:
        """Append ``tokens[i]`` to sequence ``uids[i]`` (created on first sight) and run one forward.

        A negative token ``-1 - i`` stands for id ``i`` of the last ``feed_back``. Returns float32
        logits ``[R, vocab]``, sequence after sequence: one row for the last new token of each
        sequence, except the sequences at the batch indices ``full_logits``, which get a row for
        every new token (prompt log-probabilities). Raises CapacityExceeded (changing nothing) when
        the batch breaks a limit.
        """
        if len(uids) != len(tokens) or not uids:
            raise ValueError("put needs one non-empty token list per uid")
        if len(set(uids)) != len(uids):
            raise ValueError("put got the same uid twice")
        if any(len(t) == 0 for t in tokens):
            raise ValueError("put got an empty token list")
        verdict = self.can_schedule(uids, [len(t) for t in tokens])
        if verdict is not SchedulingResult.Success:
            raise CapacityExceeded(f"cannot schedule batch: {verdict.name}")
        sequences = [self.state.get_or_create(uid) for uid in uids]
        for seq, new in zip(sequences, tokens):
            self.state.reserve(seq, len(new))
        # (a one-token entry's "every token" is its last token: graphs serve full_logits entries too)
        if self._graphs is not None and self.use_cuda_graphs and self._graphs.fits(sequences, tokens):
            logits = self._graphs.run(sequences, tokens)
        else:
            batch = RaggedBatch.build(
                sequences, tokens, self.block_size, self.device, self._staging, full_logits
            )
            ids = batch.input_ids
            if min(map(min, tokens)) < 0:
                ids = with_fed_back(ids, self._fed_back)
            logits = self.model(ids, batch.meta, self.kv_cache)
        for seq, new in zip(sequences, tokens):
            seq.seen_tokens += len(new)
        return logits

    def flush(self, uid: int) -> None:
        """Forget ``uid`` and free its KV blocks (a no-op for an unknown uid)."""
        if uid in self.state:
            self.state.flush(uid)
