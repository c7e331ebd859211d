"""PrefixCache and BlockBudget (plain Python): chained block hashes, reference counts, reuse of the
longest cached chain, LRU eviction only when the allocator needs room, and a scheduling budget that
counts shared blocks exactly."""

from __future__ import annotations

import pytest

from mii_server.engine import BlockedAllocator, PrefixCache
from mii_server.engine.prefix_cache import BlockBudget, chain_hashes

BS = 4


def test_chain_hashes_name_whole_prefixes() -> None:
    tokens = list(range(10))
    hashes = chain_hashes(tokens, BS)
    assert len(hashes) == 2  # the trailing partial block (8, 9) gets no hash
    assert chain_hashes(tokens[:8], BS) == hashes
    assert chain_hashes(tokens[4:8], BS, parent=hashes[0]) == hashes[1:]  # incremental = whole
    # the same block after a different prefix is different content
    assert chain_hashes([9, 9, 9, 9] + tokens[4:8], BS)[1] != hashes[1]
    assert chain_hashes(tokens[4:8], BS) != hashes[1:]
    assert len(set(chain_hashes([1, 2, 3, 4] * 3, BS))) == 3  # repeated blocks differ by position
    assert chain_hashes([], BS) == [] and chain_hashes([1, 2, 3], BS) == []


def cache_with_chain(n_blocks: int, chain: int) -> tuple[PrefixCache, list[int], list[bytes]]:
    """A cache whose first ``chain`` allocated blocks hold a registered prefix, still held."""
    cache = PrefixCache(n_blocks)
    blocks = cache.allocate(chain)
    assert blocks is not None
    hashes = chain_hashes(list(range(chain * BS)), BS)
    for b, h in zip(blocks, hashes):
        assert cache.register(b, h)
    return cache, blocks, hashes


def test_allocator_contract_without_sharing() -> None:
    cache = PrefixCache(4)
    held = cache.allocate(3)
    assert held is not None and len(set(held)) == 3
    assert cache.allocate(2) is None and cache.free_blocks == 1  # a failed call takes nothing
    with pytest.raises(ValueError, match="double free"):
        cache.free([held[0], held[0]])
    with pytest.raises(ValueError, match="outside the cache"):
        cache.free([held[0], 9])
    assert cache.free_blocks == 1  # refused calls changed nothing
    cache.free(held)
    assert cache.free_blocks == 4 and cache.cached_blocks == 0
    with pytest.raises(ValueError, match="double free"):
        cache.free([held[0]])
    with pytest.raises(ValueError):
        cache.allocate(-1)


def test_match_acquire_and_reference_counts() -> None:
    cache, blocks, hashes = cache_with_chain(8, 3)
    assert cache.match(hashes) == blocks
    assert cache.match(hashes[:2] + [b"x" * 16]) == blocks[:2]  # the longest leading run
    assert cache.match([b"x" * 16] + hashes[1:]) == []  # a chain with a missing head matches nothing
    assert cache.acquire(hashes[:2]) == blocks[:2]
    assert [cache.refcount(b) for b in blocks] == [2, 2, 1]
    cache.free(blocks[::-1])  # the first holder leaves: the shared blocks stay held
    assert [cache.refcount(b) for b in blocks] == [1, 1, 0]
    assert cache.free_blocks == 6  # 5 never used + 1 idle
    cache.free(blocks[1::-1])
    assert cache.free_blocks == 8 and cache.cached_blocks == 3  # idle blocks stay cached
    assert cache.match(hashes) == blocks
    assert cache.acquire(hashes) == blocks and cache.free_blocks == 5  # revived from idle
    with pytest.raises(KeyError):
        cache.acquire([b"x" * 16])


def test_register_keeps_the_first_copy_of_a_content() -> None:
    cache, blocks, hashes = cache_with_chain(8, 2)
    dup = cache.allocate(1)
    assert dup is not None
    assert not cache.register(dup[0], hashes[0])  # the same content computed twice: keep the first
    assert not cache.register(blocks[0], b"y" * 16)  # a block holds one content
    assert cache.match(hashes) == blocks
    cache.free(dup)
    assert cache.free_blocks == 6 and cache.cached_blocks == 2  # the unregistered copy is simply free


def test_idle_blocks_are_evicted_only_when_needed_least_recently_used_first() -> None:
    cache = PrefixCache(6)
    chains = []
    for first in (0, 100):  # two sequences of 2 cached blocks each
        blocks = cache.allocate(2)
        assert blocks is not None
        hashes = chain_hashes(list(range(first, first + 2 * BS)), BS)
        for b, h in zip(blocks, hashes):
            cache.register(b, h)
        chains.append((blocks, hashes))
    (a_blocks, a_hashes), (b_blocks, b_hashes) = chains
    cache.free(a_blocks[::-1])  # a released first (tail first), then b
    cache.free(b_blocks[::-1])
    got = cache.allocate(2)  # the 2 never-used blocks go first: nothing evicted
    assert got is not None and set(got).isdisjoint(a_blocks + b_blocks)
    assert cache.match(a_hashes) == a_blocks and cache.match(b_hashes) == b_blocks
    evicted = cache.allocate(1)  # now the least recently released: a's tail
    assert evicted == [a_blocks[1]]
    assert cache.match(a_hashes) == a_blocks[:1] and cache.match(b_hashes) == b_blocks
    cache.acquire(a_hashes[:1])  # a's head is used again: b's blocks are now the oldest idle
    assert cache.allocate(2) == [b_blocks[1], b_blocks[0]]
    assert cache.match(b_hashes) == [] and cache.cached_blocks == 1
    assert cache.allocate(1) is None and cache.free_blocks == 0


def test_budget_counts_shared_blocks_exactly() -> None:
    cache, blocks, hashes = cache_with_chain(10, 3)
    holders = {1: list(blocks)}  # uid 1 holds the chain; uid 2 shares its first two blocks
    cache.acquire(hashes[:2])
    holders[2] = blocks[:2] + (cache.allocate(1) or [])
    budget = lambda: BlockBudget(
        cache.free_blocks, cache.refcount, lambda uid: holders.get(uid, []), cache.match
    )
    b = budget()
    assert b.free == 6
    b.release(2)
    assert b.free == 7  # only its own block: the shared ones stay held by uid 1
    b.release(1)
    assert b.free == 10  # now everything drops to zero references
    assert b.prefix(hashes) == (3, 3)  # reusing the chain would revive its 3 (now idle) blocks
    b.reuse(hashes[:2])
    assert b.free == 8
    assert b.prefix(hashes) == (3, 1)  # revived in this step: reusing them again is free
    b.reuse(hashes)
    assert b.free == 7
    b.take(7)
    assert b.free == 0

    b = budget()  # the other order: reuse while the holder stays, then the holder leaves
    assert b.prefix(hashes) == (3, 0)
    b.reuse(hashes)
    b.release(1)
    assert b.free == 6  # uid 1's blocks are still referenced by the new sequence


def test_budget_over_a_plain_allocator() -> None:
    alloc = BlockedAllocator(5)
    held = alloc.allocate(3)
    assert held is not None
    b = BlockBudget(alloc.free_blocks, alloc.refcount, lambda uid: held if uid == 7 else [], lambda h: [])
    assert b.prefix([b"h" * 16]) == (0, 0)
    b.release(7)
    assert b.free == 5
