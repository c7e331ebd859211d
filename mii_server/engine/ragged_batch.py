"""RaggedBatch: the live tokens of many sequences packed edge to edge, with their metadata.

The host side packs every index the forward needs (ids, positions, cache slots, per-sequence
lengths, the block table) into one byte buffer in a single vectorised pass (no per-token Python);
one copy moves it to the device, where the fields are views of that one buffer. A decode-only batch can be padded to a
CUDA-graph rung (``num_seqs``) and a fixed block-table width (``table_width``): padded tokens get
slot -1 (the KV append skips them) and padded sequences get no new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from ..kernels import AttentionMetadata
from .state_manager import SequenceDescriptor

_ALIGN = 16  # bytes; why: Triton specialises kernels on 16-byte pointer alignment, so every field
# starts aligned (else batch shapes would flip the alignment and trigger recompiles)


@dataclass(frozen=True)
class BatchLayout:
    """Where each field lives in the packed buffer (each field 16-byte aligned)."""

    num_tokens: int  # T: token rows (padding included)
    num_seqs: int  # S: sequence rows (padding included)
    table_width: int  # W: block-table columns
    num_logits: int | None = None  # R: tokens whose logits are computed; None: one per sequence (S)

    @property
    def logit_rows(self) -> int:
        return self.num_seqs if self.num_logits is None else self.num_logits

    def fields(self) -> dict[str, tuple[int, int, str]]:
        """name -> (byte offset, element count, dtype name)."""
        t, s, w, r = self.num_tokens, self.num_seqs, self.table_width, self.logit_rows
        sizes = [("ids", t, "int64"), ("positions", t, "int64"), ("slots", t, "int64"), ("last", r, "int64"),
                 ("cu", s + 1, "int32"), ("context", s, "int32"), ("table", s * w, "int32")]  # fmt: skip
        out, offset = {}, 0
        for name, count, dtype in sizes:
            out[name] = (offset, count, dtype)
            offset += -(-count * (8 if dtype == "int64" else 4) // _ALIGN) * _ALIGN
        return out

    @property
    def nbytes(self) -> int:
        offset, count, _ = self.fields()["table"]
        return offset + count * 4

    def views(
        self, buffer: torch.Tensor, max_q_len: int, max_context_len: int, num_decode_seqs: int = 0
    ) -> RaggedBatch:
        """The batch whose tensors are views of ``buffer`` (uint8, at least ``nbytes`` long)."""
        f = {
            name: buffer[off : off + count * (8 if dtype == "int64" else 4)].view(getattr(torch, dtype))
            for name, (off, count, dtype) in self.fields().items()
        }
        meta = AttentionMetadata(
            positions=f["positions"],
            slot_mapping=f["slots"],
            cu_q_lens=f["cu"],
            context_lens=f["context"],
            block_table=f["table"].view(self.num_seqs, self.table_width),
            last_token_indices=f["last"],
            max_q_len=max_q_len,
            max_context_len=max_context_len,
            num_decode_seqs=num_decode_seqs,
        )
        return RaggedBatch(input_ids=f["ids"], meta=meta)


@dataclass
class PackedBatch:
    """A batch packed on the host, ready for one copy to the device."""

    layout: BatchLayout
    data: np.ndarray  # uint8[layout.nbytes]
    max_q_len: int  # over the real sequences
    max_context_len: int  # over the real sequences
    num_decode_seqs: int = 0  # leading sequences with exactly one new token


def pack_batch(
    sequences: Sequence[SequenceDescriptor],
    tokens: Sequence[Sequence[int]],
    block_size: int,
    num_seqs: int | None = None,
    table_width: int | None = None,
    full_logits: Sequence[int] = (),
) -> PackedBatch:
    """Pack ``tokens[i]`` as the next tokens of ``sequences[i]`` (vectorised; no per-token Python).

    Each descriptor must already hold blocks for its new tokens and still report the tokens seen
    *before* this batch in ``seen_tokens``. ``num_seqs`` pads to that many sequences *and* tokens
    (decode-only batches, for a CUDA-graph rung); ``table_width`` fixes the block-table width.
    The sequences at the indices ``full_logits`` get logits for every new token, the others for
    their last one.
    """
    n = len(sequences)
    q_lens = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=n)  # [n]
    starts = np.fromiter((seq.seen_tokens for seq in sequences), dtype=np.int64, count=n)
    held = np.fromiter((len(seq.blocks) for seq in sequences), dtype=np.int64, count=n)
    real_tokens = int(q_lens.sum())
    s = n if num_seqs is None else num_seqs
    t = real_tokens if num_seqs is None else num_seqs
    most_blocks = int(held.max(initial=0))
    w = most_blocks if table_width is None else table_width
    if s < n or t < real_tokens or w < most_blocks:
        raise ValueError(
            f"cannot pad {n} sequences / {real_tokens} tokens / {most_blocks} blocks to {s}/{t}/{w}"
        )
    rows_per_seq = None  # logit rows of each real sequence, when some want more than one
    if full_logits:
        if num_seqs is not None:
            raise ValueError("padded batches compute one logit row per sequence")
        rows_per_seq = np.ones(n, dtype=np.int64)
        rows_per_seq[list(full_logits)] = q_lens[list(full_logits)]
    layout = BatchLayout(t, s, w, None if rows_per_seq is None else int(rows_per_seq.sum()))
    data = np.zeros(layout.nbytes, dtype=np.uint8)
    f = {
        name: data[off : off + count * (8 if dtype == "int64" else 4)].view(dtype)
        for name, (off, count, dtype) in layout.fields().items()
    }
    ids, positions, slots, last = f["ids"], f["positions"], f["slots"], f["last"]
    cu, context, table = f["cu"], f["context"], f["table"].reshape(s, w)

    cu[0] = 0
    np.cumsum(q_lens, out=cu[1 : n + 1])
    cu[n + 1 :] = real_tokens  # padded sequences own no tokens
    context[:n] = starts + q_lens
    context[n:] = 0
    flat_blocks = np.fromiter(chain.from_iterable(seq.blocks for seq in sequences), dtype=np.int32)
    table[np.repeat(np.arange(n), held), _ranks(held)] = flat_blocks

    ids[:real_tokens] = np.fromiter(chain.from_iterable(tokens), dtype=np.int64, count=real_tokens)
    row = np.repeat(np.arange(n), q_lens)  # [T real]: sequence of each token
    pos = _ranks(q_lens) + starts[row]
    positions[:real_tokens] = pos
    slots[:real_tokens] = table[row, pos // block_size].astype(np.int64) * block_size + pos % block_size
    ids[real_tokens:] = 0
    positions[real_tokens:] = 0
    slots[real_tokens:] = -1  # why: the KV append skips negative slots, so padding writes nothing
    if rows_per_seq is None:
        last[:n] = cu[1 : n + 1] - 1
        last[n:] = np.arange(n, s)  # padding only happens with t == s: each padded row points at itself
    else:  # the last rows_per_seq[i] tokens of sequence i, in order
        last[:] = np.repeat(cu[1 : n + 1] - rows_per_seq, rows_per_seq) + _ranks(rows_per_seq)
    single = q_lens == 1  # the leading run of these is the batch's decode rows
    return PackedBatch(
        layout=layout,
        data=data,
        max_q_len=int(q_lens.max(initial=0)),
        max_context_len=int(context[:n].max(initial=0)),
        num_decode_seqs=n if single.all() else int(single.argmin()),
    )


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated: [2, 3] -> [0, 1, 0, 1, 2]."""
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - offsets


def with_fed_back(input_ids: torch.Tensor, fed_back: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each placeholder ``-1 - i`` replaced by ``fed_back[i]``, on the device
    (no host round trip: this is how a step consumes tokens the previous step sampled)."""
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, fed_back.index_select(0, rows), input_ids)


class HostStaging:
    """A reusable (pinned, on CUDA) host buffer that uploads a packed batch in one copy.

    The copy is asynchronous; before the buffer is overwritten, the previous copy is waited for
    (tensor-parallel followers never sync on logits, so they could otherwise run ahead of it).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._copied: torch.cuda.Event | None = None

    def upload(self, packed: PackedBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``packed`` to the device: into ``out`` (uint8, on the device) or a new tensor."""
        nbytes = packed.layout.nbytes
        if not self._pinned:
            host = torch.from_numpy(packed.data)
            if out is None:
                return host.to(self.device, copy=True)
            out[:nbytes].copy_(host)
            return out
        if self._copied is not None:
            self._copied.synchronize()
        if self._host.numel() < nbytes:
            self._host = torch.empty(max(nbytes, 2 * self._host.numel()), dtype=torch.uint8, pin_memory=True)
        host = self._host[:nbytes]
        host.numpy()[:] = packed.data
        if out is None:
            out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        out[:nbytes].copy_(host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out


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
        staging: HostStaging | None = None,
        full_logits: Sequence[int] = (),
    ) -> RaggedBatch:
        """Pack ``tokens[i]`` as the next tokens of ``sequences[i]`` and move them to ``device``.

        Each descriptor must already hold blocks for its new tokens and still report the tokens
        seen *before* this batch in ``seen_tokens``. ``full_logits``: as in ``pack_batch``.
        """
        packed = pack_batch(sequences, tokens, block_size, full_logits=full_logits)
        buffer = (staging or HostStaging(device)).upload(packed)
        return packed.layout.views(buffer, packed.max_q_len, packed.max_context_len, packed.num_decode_seqs)
