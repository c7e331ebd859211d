"""BlockedAllocator: the one owner of free KV-cache blocks. Plain Python, no torch."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockedAllocator:
    """Hands out block ids in ``range(num_blocks)``.

    Running out of room is a return value (``allocate`` gives None and changes nothing); freeing a
    block that is not allocated is a bug in the caller and raises ``ValueError``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"an allocator needs at least one block, not {num_blocks}")
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._allocated = bytearray(num_blocks)  # 1 where the block is handed out

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        """1 while ``block`` is handed out, else 0 (blocks are never shared here)."""
        return self._allocated[block]

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks, or return None (taking none) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._allocated[b] = 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks. Raises ``ValueError`` on an unknown or already free block (changing nothing)."""
        blocks = list(blocks)
        seen: set[int] = set()
        for b in blocks:
            if not 0 <= b < self._num_blocks:
                raise ValueError(f"block {b} is outside the cache (0..{self._num_blocks - 1})")
            if not self._allocated[b] or b in seen:
                raise ValueError(f"double free of block {b}")
            seen.add(b)
        for b in blocks:
            self._allocated[b] = 0
            self._free.append(b)
