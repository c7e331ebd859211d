"""RaggedBatch: the live tokens of many sequences packed edge to edge, with their metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernels import AttentionMetadata
from .state_manager import SequenceDescriptor


@dataclass
class RaggedBatch:
    """One forward pass worth of tokens: a flat id stream plus the attention metadata."""

    input_ids: torch.Tensor  # int64[T]: every new token of every sequence, sequence after sequence
    meta: AttentionMetadata  # positions, cache slots, per-sequence lengths and the dense block table

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        sequences: Sequence[SequenceDescriptor],
        tokens: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
    ) -> RaggedBatch:
        """Pack ``tokens[i]`` as the next tokens of ``sequences[i]``.

        Each descriptor must already hold blocks for its new tokens and still report the tokens
        seen *before* this batch in ``seen_tokens``.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q_lens = [0]
        context_lens: list[int] = []
        max_blocks = max(len(seq.blocks) for seq in sequences)
        table = torch.zeros((len(sequences), max_blocks), dtype=torch.int32)
        for row, (seq, new) in enumerate(zip(sequences, tokens)):
            start = seq.seen_tokens
            ids.extend(new)
            for pos in range(start, start + len(new)):
                positions.append(pos)
                slots.append(seq.blocks[pos // block_size] * block_size + pos % block_size)
            cu_q_lens.append(cu_q_lens[-1] + len(new))
            context_lens.append(start + len(new))
            table[row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        q_lens = [len(t) for t in tokens]
        pin = device.type == "cuda"

        def to_device(values: list[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
            if pin:
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        meta = AttentionMetadata(
            positions=to_device(positions, torch.int64),
            slot_mapping=to_device(slots, torch.int64),
            cu_q_lens=to_device(cu_q_lens, torch.int32),
            context_lens=to_device(context_lens, torch.int32),
            block_table=to_device(table, torch.int32),
            last_token_indices=to_device([c - 1 for c in cu_q_lens[1:]], torch.int64),
            max_q_len=max(q_lens),
            max_context_len=max(context_lens),
        )
        return cls(input_ids=to_device(ids, torch.int64), meta=meta)
