"""PenaltyCounts: per-request token counts on the device, for presence / frequency / repetition
penalties applied to a whole batch of logits at once.

Each request with a penalty holds one row of two device tables for its life: how often each token
occurs in its output (updated on the device from the sampled ids, so an overlapped step that samples
before the host has read the previous token back still counts it), and which tokens its prompt holds
(for the repetition penalty, which counts the prompt as transformers' does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampler import to_device


class PenaltyCounts:
    """Rows of ``[P, vocab]`` tables, one per live request with a penalty (grown by doubling)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)  # [P, V] output counts
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [P, V] in the prompt
        self._row_of: dict[int, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._row_of)

    def row(self, uid: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """The row of request ``uid``, set up from its tokens on first use."""
        row = self._row_of.get(uid)
        if row is not None:
            return row
        if not self._free:
            self._grow()
        row = self._row_of[uid] = self._free.pop()
        self.prompt[row].zero_()
        self.prompt[row, to_device(list(prompt_ids), torch.int64, self.device)] = True
        self.output[row].zero_()
        if output_ids:  # (a request gets its row when it first samples: normally no output yet)
            ids = to_device(list(output_ids), torch.int64, self.device)
            self.output[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return row

    def release(self, uid: int) -> None:
        """Give the row of ``uid`` back (a no-op for a request that has none)."""
        row = self._row_of.pop(uid, None)
        if row is not None:
            self._free.append(row)

    def _grow(self) -> None:
        old = self.output.shape[0]
        new = max(8, 2 * old)
        self.output = torch.cat([self.output, self.output.new_zeros(new - old, self.vocab_size)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(new - old, self.vocab_size)])
        self._free.extend(range(new - 1, old - 1, -1))

    def apply(
        self,
        logits: torch.Tensor,
        batch_rows: torch.Tensor,
        table_rows: torch.Tensor,
        presence: torch.Tensor,
        frequency: torch.Tensor,
        repetition: torch.Tensor,
    ) -> None:
        """Penalise ``logits[batch_rows[j]]`` (in place) by the counts of ``table_rows[j]``.

        logits: float32 [S, V]; batch_rows, table_rows: int64 [P]; the penalties: float32 [P].
        Repetition first (transformers' rule: positive logits divided, negative multiplied), then
        OpenAI's ``logit -= frequency * count + presence * (count > 0)`` (vLLM's order).
        """
        counts = self.output.index_select(0, table_rows)  # [P, V]
        in_output = counts > 0
        seen = in_output | self.prompt.index_select(0, table_rows)  # [P, V]
        sub = logits.index_select(0, batch_rows)  # [P, V]
        rep = repetition[:, None]
        sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
        sub = sub - frequency[:, None] * counts - presence[:, None] * in_output
        logits.index_copy_(0, batch_rows, sub)

    def count(self, table_rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Add one occurrence of ``ids[j]`` (int64 [P], on the device) to row ``table_rows[j]``."""
        self.output.index_put_((table_rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
