"""PrefixCache: KV blocks shared by content, reference-counted, evicted least recently used.
Plain Python, no torch.

A full block is named by the hash of its tokens chained with the hash of the block before it, so
equal hashes mean equal whole prefixes (not just equal blocks). A sequence whose leading blocks are
cached takes them (reference count + 1) instead of recomputing them. A block nobody holds any more
stays cached ("idle") until the allocator runs out of never-used blocks; then the idle block
released longest ago is evicted and handed out again.

Cached blocks are never written: a sequence only writes at positions past the blocks it reused (a
request that would hit every block of its prompt recomputes the last one), so no copy-on-write.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from .allocator import BlockedAllocator

# Bytes of a block hash. blake2b is a cryptographic hash: a request cannot craft tokens that collide
# with another's cached prefix (Python's tuple hash would let it read someone else's KV).
HASH_BYTES = 16


def chain_hashes(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Hashes of the full blocks of ``tokens`` (a trailing partial block gets none), each chained
    to the previous one; ``parent`` is the hash of the block before ``tokens[0]`` (b"" at the start)."""
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("q", tokens[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Owns every KV block when prefix caching is on; ``allocate`` / ``free`` / ``free_blocks`` as
    ``BlockedAllocator``'s, plus sharing.

    ``free_blocks`` counts idle cached blocks too: they are handed out (evicted) when the never-used
    ones run out. ``free`` drops one reference per listed block; a block whose last reference goes
    becomes idle if it is cached, else free. Misuse (freeing more references than held) raises
    ``ValueError`` and changes nothing.
    """

    def __init__(self, num_blocks: int) -> None:
        self._allocator = BlockedAllocator(num_blocks)  # blocks that hold no cached content
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # cached block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> cached block
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first

    @property
    def num_blocks(self) -> int:
        return self._allocator.num_blocks

    @property
    def free_blocks(self) -> int:
        return self._allocator.free_blocks + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        """Blocks whose content is findable by hash (held or idle)."""
        return len(self._block_of)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (never-used ones first, then evicting idle ones, least recently used
        first), or return None (changing nothing) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.free_blocks:
            return None
        blocks = self._allocator.allocate(min(n, self._allocator.free_blocks))
        assert blocks is not None
        while len(blocks) < n:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            blocks.append(block)
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per entry of ``blocks``, in order: of the blocks that become idle,
        the first listed is evicted first."""
        blocks = list(blocks)
        for b, count in Counter(blocks).items():
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block {b} is outside the cache (0..{self.num_blocks - 1})")
            if count > self._refs[b]:
                raise ValueError(f"double free of block {b}")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._hash_of:
                self._idle[b] = None
            else:
                self._allocator.free([b])

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest leading run of ``hashes`` (changes nothing)."""
        out = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def acquire(self, hashes: Sequence[bytes]) -> list[int]:
        """Take one more reference to the cached block of each hash (all must be cached)."""
        blocks = [self._block_of[h] for h in hashes]
        for b in blocks:
            if not self._refs[b]:
                del self._idle[b]
            self._refs[b] += 1
        return blocks

    def register(self, block: int, block_hash: bytes) -> bool:
        """Make the held, full ``block`` findable as ``block_hash``. False (nothing changes) when
        that content is cached already in another block, or ``block`` is cached under another hash."""
        assert self._refs[block] > 0, f"registering block {block}, which nobody holds"
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True


class BlockBudget:
    """The allocatable blocks while one step is being scheduled, as the engine will count them when
    it runs that step's flushes, prefix reuses and reservations (in that order).

    Releasing a sequence frees only the blocks nobody else holds; reusing an idle cached block takes
    it out of the free count; reusing a block that is held (or already revived in this step) is free.
    """

    def __init__(
        self,
        free: int,
        refcount: Callable[[int], int],
        blocks_of: Callable[[int], Sequence[int]],
        match: Callable[[Sequence[bytes]], list[int]],
    ) -> None:
        self.free = free
        self._refcount = refcount
        self._blocks_of = blocks_of  # uid -> the blocks its sequence holds
        self._match = match  # hashes -> cached blocks of their leading run
        self._delta: dict[int, int] = {}  # block -> references gained (+) or dropped (-) in this step

    def _refs(self, block: int) -> int:
        return self._refcount(block) + self._delta.get(block, 0)

    def release(self, uid: int) -> None:
        """The sequence ``uid`` is flushed in this step."""
        for b in self._blocks_of(uid):
            self._delta[b] = self._delta.get(b, 0) - 1
            if self._refs(b) == 0:
                self.free += 1

    def prefix(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(cached leading blocks of ``hashes``, free blocks that reusing them would take)."""
        blocks = self._match(hashes)
        return len(blocks), sum(1 for b in set(blocks) if self._refs(b) == 0)

    def reuse(self, hashes: Sequence[bytes]) -> None:
        """A sequence takes the cached blocks of ``hashes`` (all cached) in this step."""
        blocks = self._match(hashes)
        assert len(blocks) == len(hashes), "reusing blocks that are not cached"
        for b in blocks:
            if self._refs(b) == 0:
                self.free -= 1
            self._delta[b] = self._delta.get(b, 0) + 1

    def take(self, n: int) -> None:
        """``n`` blocks are allocated in this step."""
        self.free -= n
