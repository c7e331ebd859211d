"""StateManager: sequence descriptors (uid -> block table, tokens seen). Plain Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..errors import CapacityExceeded


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` token slots."""
    return -(-num_tokens // block_size)


@dataclass
class SequenceDescriptor:
    """The engine's view of one sequence."""

    uid: int  # caller's id for the sequence
    blocks: list[int] = field(default_factory=list)  # KV blocks in sequence order
    seen_tokens: int = 0  # tokens whose keys and values are in the cache

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class BlockSource(Protocol):
    """Where blocks come from: a ``BlockedAllocator``, or a ``PrefixCache`` when blocks are shared."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    def refcount(self, block: int) -> int: ...

    def allocate(self, n: int) -> list[int] | None: ...

    def free(self, blocks: list[int]) -> None: ...


class StateManager:
    """Tracks every live sequence and the blocks it holds; blocks come from one allocator."""

    def __init__(self, allocator: BlockSource, block_size: int, max_tracked_sequences: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_tracked_sequences = max_tracked_sequences
        self._sequences: dict[int, SequenceDescriptor] = {}

    def __contains__(self, uid: int) -> bool:
        return uid in self._sequences

    def __len__(self) -> int:
        return len(self._sequences)

    def get(self, uid: int) -> SequenceDescriptor | None:
        return self._sequences.get(uid)

    def get_or_create(self, uid: int) -> SequenceDescriptor:
        seq = self._sequences.get(uid)
        if seq is None:
            if len(self._sequences) >= self.max_tracked_sequences:
                raise CapacityExceeded(
                    f"already tracking {self.max_tracked_sequences} sequences (max_tracked_sequences)"
                )
            seq = self._sequences[uid] = SequenceDescriptor(uid)
        return seq

    def adopt(self, uid: int, blocks: list[int]) -> SequenceDescriptor:
        """Start the new sequence ``uid`` with ``blocks`` (full, already holding its first tokens'
        KV and referenced for it) as its first blocks."""
        if uid in self._sequences:
            raise ValueError(f"sequence {uid} exists already; only a new sequence starts from cached blocks")
        seq = self.get_or_create(uid)
        seq.blocks.extend(blocks)
        seq.seen_tokens = len(blocks) * self.block_size
        return seq

    def blocks_needed(self, uid: int, new_tokens: int) -> int:
        """Extra blocks the sequence ``uid`` (new or live) needs to append ``new_tokens`` tokens."""
        seq = self._sequences.get(uid)
        seen, have = (0, 0) if seq is None else (seq.seen_tokens, len(seq.blocks))
        return max(0, blocks_for(seen + new_tokens, self.block_size) - have)

    def reserve(self, seq: SequenceDescriptor, new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``new_tokens`` more tokens; raise CapacityExceeded if
        the cache cannot (then nothing changes)."""
        need = self.blocks_needed(seq.uid, new_tokens)
        if need:
            blocks = self.allocator.allocate(need)
            if blocks is None:
                raise CapacityExceeded(
                    f"sequence {seq.uid} needs {need} more KV blocks, {self.allocator.free_blocks} are free"
                )
            seq.blocks.extend(blocks)

    def flush(self, uid: int) -> int:
        """Forget ``uid`` and return its blocks to the allocator; returns how many were freed.
        An unknown uid raises KeyError."""
        seq = self._sequences.pop(uid)
        # last block first: when they are cached, a prefix's tail is evicted before its head (a
        # head is worth more: every longer prefix needs it)
        self.allocator.free(seq.blocks[::-1])
        return len(seq.blocks)
