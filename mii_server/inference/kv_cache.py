"""The KV cache of kernel-injected decoders, and the transformers ``Cache`` that ``generate`` carries.

``KVPool`` owns the storage: per layer a blocked pool ``[rows * blocks_per_row, block_size, Hk, D]``
where batch row b owns the contiguous blocks ``b * blocks_per_row ...`` (its block table is fixed), plus
each row's token count on the device. ``InjectedCache`` is one generation's view of a pool: a
``transformers.Cache`` subclass, so ``generate`` passes it from step to step like its own caches, that
knows the batch size and how many input columns (padding included) it has seen. A pool serves one
cache at a time; starting a new one retires the previous, and a retired cache raises if used again.

Rows hold real tokens only: a padding column of the attention mask takes no slot, so a left-padded
row's tokens sit at slots 0, 1, ... like an unpadded row's.
"""

from __future__ import annotations

import torch
from transformers import Cache

from ..engine.kv_cache import BlockedKVCache
from ..errors import CapacityExceeded, InvalidRequest


class KVPool:
    """Keys, values and per-row token counts for ``rows`` batch rows of ``capacity`` tokens each.

    ``storage`` holds ``blocks_needed(rows, capacity, block_size)`` blocks. Build the pool outside
    ``torch.inference_mode`` (``generate`` may run under it or not, and a tensor made in inference
    mode can never again be updated in place outside it).
    """

    def __init__(self, storage: BlockedKVCache, rows: int, capacity: int) -> None:
        device = storage.keys[0].device
        self.storage = storage
        self.rows = rows
        self.blocks_per_row = storage.num_blocks // rows
        self.capacity = capacity  # tokens one row may hold
        self.row_slots = self.blocks_per_row * storage.block_size  # slots from one row's start to the next
        assert self.row_slots >= capacity
        blocks = torch.arange(rows * self.blocks_per_row, dtype=torch.int32, device=device)
        self.block_table = blocks.view(rows, self.blocks_per_row)  # int32 [rows, blocks_per_row]
        self.lengths = torch.zeros(rows, dtype=torch.int32, device=device)  # real tokens held per row
        self.owner: InjectedCache | None = None

    @staticmethod
    def blocks_needed(rows: int, capacity: int, block_size: int) -> int:
        return rows * -(-capacity // block_size)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage.layer(index)

    def start(self, batch_size: int) -> InjectedCache:
        """A fresh cache over this pool's first ``batch_size`` rows; the previous cache is retired."""
        assert batch_size <= self.rows
        self.lengths[:batch_size].zero_()
        self.owner = InjectedCache(self, batch_size)
        return self.owner

    def row_views(self, batch_size: int) -> list[torch.Tensor]:
        """Every layer's keys then values as [batch_size, row_slots, Hk, D] views (rows contiguous)."""
        pools = (*self.storage.keys, *self.storage.values)
        return [t.view(self.rows, self.row_slots, *t.shape[2:])[:batch_size] for t in pools]


class InjectedCache(Cache):
    """One generation's KV state in a ``KVPool``, as ``generate`` sees a cache.

    ``get_seq_length()`` counts input columns seen (padding included), which is what ``generate``
    slices the next inputs by. Beam search's ``reorder_cache`` is supported; cropping and batch
    reshaping (assisted and contrastive decoding) are not, and raise.
    """

    def __init__(self, pool: KVPool, batch_size: int) -> None:
        super().__init__(layers=[])
        self.pool = pool
        self.num_rows = batch_size
        self.seen = 0  # input columns consumed so far, padding included
        self.longest = 0  # upper bound of the real tokens any row holds (exact after a prefill)

    def check_live(self, batch_size: int) -> None:
        if self.pool.owner is not self:
            raise InvalidRequest("this KV cache was superseded by a newer generation on the same model")
        if batch_size != self.num_rows:
            raise InvalidRequest(f"the KV cache holds {self.num_rows} rows, the inputs have {batch_size}")

    def reserve(self, new_tokens: int) -> None:
        """Raise ``CapacityExceeded`` when ``new_tokens`` more tokens may not fit every row."""
        if self.longest + new_tokens > self.pool.capacity:
            raise CapacityExceeded(
                f"a sequence would hold {self.longest + new_tokens} tokens; the injected KV cache holds "
                f"{self.pool.capacity} per sequence (raise init_inference's max_out_tokens)"
            )

    # ---- the transformers Cache interface --------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows until max_out_tokens (like a dynamic cache, it states no maximum)

    def reset(self) -> None:
        self.check_live(self.num_rows)
        self.pool.lengths[: self.num_rows].zero_()
        self.seen = self.longest = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b takes the KV state of row ``beam_idx[b]``."""
        self.check_live(self.num_rows)
        index = beam_idx.to(self.pool.lengths.device)
        used = min(self.longest, self.pool.row_slots)
        for rows in self.pool.row_views(self.num_rows):
            rows[:, :used] = rows[index, :used]
        lengths = self.pool.lengths[: self.num_rows]
        lengths.copy_(lengths[index])

    def crop(self, max_length: int) -> None:
        raise InvalidRequest(
            "the kernel-injected KV cache cannot be cropped (assisted decoding is not supported)"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise InvalidRequest("the kernel-injected KV cache cannot be expanded after its prefill")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise InvalidRequest(
            "the kernel-injected KV cache cannot select rows (contrastive search is not supported)"
        )
