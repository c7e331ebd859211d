"""Attention metadata: the tensors that describe one ragged batch to the attention kernels.

Built once per forward by the engine's RaggedBatch and passed down to every layer (never stashed
in a global). Kernels import nothing from the engine; this dataclass is their whole contract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    """Where each token of a flat ragged batch lives and what it may attend to.

    The batch holds T tokens of S sequences packed edge to edge: sequence s owns tokens
    ``cu_q_lens[s]:cu_q_lens[s+1]``, which sit at positions ``context_lens[s] - q_len(s) ...
    context_lens[s] - 1`` of that sequence. Each token attends causally to every earlier position of
    its own sequence, whose keys and values live in the blocked KV cache at the blocks of
    ``block_table[s]``.
    """

    positions: torch.Tensor  # int64[T]: position of each token in its sequence
    slot_mapping: torch.Tensor  # int64[T]: block * block_size + offset where the token's K/V is written
    cu_q_lens: torch.Tensor  # int32[S+1]: prefix sums of new-token counts per sequence
    context_lens: torch.Tensor  # int32[S]: tokens in the cache per sequence once this batch is written
    block_table: torch.Tensor  # int32[S, max_blocks]: cache blocks of each sequence, padded with 0
    # int64[R]: flat-batch indices of the tokens whose logits the LM head computes: each sequence's
    # last token (R = S), or every new token of a sequence that asks for prompt log-probabilities
    last_token_indices: torch.Tensor
    max_q_len: int  # longest run of new tokens of any sequence (1 for a decode-only batch)
    max_context_len: int  # longest context of any sequence after this batch
    # leading sequences with exactly one new token each (a mixed batch's decode rows come first);
    # 0 where the builder does not count them. A mixed batch sends them to the decode kernel when
    # they are enough to fill the GPU (triton_attention.fills_gpu_unsplit).
    num_decode_seqs: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_q_len == 1

    @cached_property
    def leading_decodes(self) -> AttentionMetadata:
        """The batch of the first ``num_decode_seqs`` sequences alone (views from the front, so their
        pointers keep this batch's alignment); built once per batch, shared by every layer."""
        n = self.num_decode_seqs
        return dataclasses.replace(
            self, positions=self.positions[:n], slot_mapping=self.slot_mapping[:n], cu_q_lens=self.cu_q_lens[: n + 1],
            context_lens=self.context_lens[:n], block_table=self.block_table[:n], max_q_len=1,
        )  # fmt: skip

    @cached_property
    def trailing_prompts(self) -> AttentionMetadata:
        """The batch of the sequences after the first ``num_decode_seqs`` alone, counted from zero (their
        ``cu_q_lens`` rebased), for a kernel that takes no ``first_seq`` offset; built once per batch."""
        n = self.num_decode_seqs
        start = self.cu_q_lens[n : n + 1]
        return dataclasses.replace(
            self, positions=self.positions[n:], slot_mapping=self.slot_mapping[n:],
            cu_q_lens=self.cu_q_lens[n:] - start, context_lens=self.context_lens[n:],
            block_table=self.block_table[n:], last_token_indices=self.last_token_indices[n:] - start.long(),
            num_decode_seqs=0,
        )  # fmt: skip
