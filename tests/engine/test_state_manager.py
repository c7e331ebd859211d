"""StateManager: block reservation per sequence, flush, blocks_needed and the sequence cap."""

from __future__ import annotations

import pytest

from mii_server.engine import BlockedAllocator, StateManager
from mii_server.engine.state_manager import blocks_for
from mii_server.errors import CapacityExceeded


def make(num_blocks: int = 10, block_size: int = 4, max_tracked: int = 3) -> StateManager:
    return StateManager(BlockedAllocator(num_blocks), block_size, max_tracked)


def test_blocks_for() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_blocks_needed_counts_only_extra_blocks() -> None:
    sm = make()
    assert sm.blocks_needed(7, 0) == 0  # unknown uid: a new sequence
    assert sm.blocks_needed(7, 1) == 1
    assert sm.blocks_needed(7, 9) == 3
    seq = sm.get_or_create(7)
    sm.reserve(seq, 5)
    seq.seen_tokens = 5
    assert len(seq.blocks) == 2
    assert sm.blocks_needed(7, 3) == 0  # fits in the second block's free slots
    assert sm.blocks_needed(7, 4) == 1
    assert sm.blocks_needed(7, 12) == 3


def test_reserve_grows_the_block_table() -> None:
    sm = make()
    seq = sm.get_or_create(1)
    sm.reserve(seq, 6)
    assert len(seq.blocks) == 2 and seq.capacity(4) == 8
    sm.reserve(seq, 2)  # seen_tokens is still 0: 2 tokens fit in what it holds
    assert len(seq.blocks) == 2
    seq.seen_tokens = 6
    sm.reserve(seq, 3)
    assert len(seq.blocks) == 3
    assert sm.allocator.free_blocks == 7
    assert len(set(seq.blocks)) == 3


def test_reserve_beyond_the_cache_raises_and_changes_nothing() -> None:
    sm = make(num_blocks=4)
    a = sm.get_or_create(1)
    sm.reserve(a, 8)
    b = sm.get_or_create(2)
    with pytest.raises(CapacityExceeded, match="needs 3 more KV blocks, 2 are free"):
        sm.reserve(b, 9)
    assert b.blocks == [] and sm.allocator.free_blocks == 2
    sm.reserve(b, 8)
    assert sm.allocator.free_blocks == 0


def test_flush_returns_every_block() -> None:
    sm = make(num_blocks=10)
    for uid, tokens in [(1, 5), (2, 12), (3, 1)]:
        sm.reserve(sm.get_or_create(uid), tokens)
    assert sm.allocator.free_blocks == 10 - (2 + 3 + 1)
    assert sm.flush(2) == 3
    assert 2 not in sm and len(sm) == 2
    assert sm.flush(1) == 2
    assert sm.flush(3) == 1
    assert len(sm) == 0
    assert sm.allocator.free_blocks == 10
    assert sorted(sm.allocator.allocate(10) or []) == list(range(10))


def test_flush_unknown_uid_raises_key_error() -> None:
    with pytest.raises(KeyError):
        make().flush(42)


def test_max_tracked_sequences() -> None:
    sm = make(max_tracked=2)
    sm.get_or_create(1)
    sm.get_or_create(2)
    assert sm.get_or_create(1) is sm.get(1)  # existing sequences are not new ones
    with pytest.raises(CapacityExceeded, match="max_tracked_sequences"):
        sm.get_or_create(3)
    assert 3 not in sm and len(sm) == 2
    sm.flush(1)
    sm.get_or_create(3)
    assert len(sm) == 2
