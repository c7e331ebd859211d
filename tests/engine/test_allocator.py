"""BlockedAllocator: exhaustion is a return value, misuse raises, and nothing leaks."""

from __future__ import annotations

import pytest

from mii_server.engine import BlockedAllocator


def test_allocate_hands_out_distinct_blocks_in_range() -> None:
    alloc = BlockedAllocator(8)
    first = alloc.allocate(3)
    second = alloc.allocate(5)
    assert first is not None and second is not None
    assert sorted(first + second) == list(range(8))
    assert alloc.free_blocks == 0
    assert alloc.allocate(0) == []


def test_exhaustion_returns_none_and_takes_nothing() -> None:
    alloc = BlockedAllocator(4)
    held = alloc.allocate(3)
    assert held is not None
    assert alloc.allocate(2) is None
    assert alloc.free_blocks == 1  # the failed call took nothing
    last = alloc.allocate(1)
    assert last is not None and sorted(held + last) == [0, 1, 2, 3]
    assert alloc.allocate(1) is None
    assert alloc.free_blocks == 0


def test_negative_allocation_raises() -> None:
    with pytest.raises(ValueError):
        BlockedAllocator(4).allocate(-1)


def test_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockedAllocator(0)


def test_double_free_raises_and_changes_nothing() -> None:
    alloc = BlockedAllocator(4)
    blocks = alloc.allocate(2)
    assert blocks is not None
    alloc.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([blocks[0]])
    assert alloc.free_blocks == 4
    # A list that frees one block twice is refused whole: the first block stays allocated.
    held = alloc.allocate(1)
    assert held is not None
    with pytest.raises(ValueError, match="double free"):
        alloc.free([held[0], held[0]])
    assert alloc.free_blocks == 3
    alloc.free(held)
    assert alloc.free_blocks == 4


def test_never_allocated_block_raises() -> None:
    alloc = BlockedAllocator(4)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([2])
    assert alloc.free_blocks == 4


@pytest.mark.parametrize("block", [-1, 4, 100])
def test_out_of_range_free_raises_and_changes_nothing(block: int) -> None:
    alloc = BlockedAllocator(4)
    held = alloc.allocate(2)
    assert held is not None
    with pytest.raises(ValueError, match="outside the cache"):
        alloc.free([held[0], block])
    assert alloc.free_blocks == 2  # held[0] was not freed either
    alloc.free(held)
    assert alloc.free_blocks == 4


def test_freed_blocks_are_reused() -> None:
    alloc = BlockedAllocator(3)
    a = alloc.allocate(3)
    assert a is not None
    alloc.free([a[1]])
    assert alloc.allocate(1) == [a[1]]
