"""RaggedBatch packing: one vectorised pass gives the per-token metadata a naive loop gives, and
padding to a CUDA-graph rung adds only inert rows (slot -1, no tokens, zero context)."""

from __future__ import annotations

import torch

from mii_server.engine.ragged_batch import HostStaging, RaggedBatch, pack_batch
from mii_server.engine.state_manager import SequenceDescriptor

BLOCK = 4


def naive(sequences: list[SequenceDescriptor], tokens: list[list[int]]) -> dict[str, list]:
    """The metadata spelled out token by token (the packing's oracle)."""
    ids, positions, slots, cu, ctx = [], [], [], [0], []
    for seq, new in zip(sequences, tokens):
        ids += new
        for pos in range(seq.seen_tokens, seq.seen_tokens + len(new)):
            positions.append(pos)
            slots.append(seq.blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
        cu.append(cu[-1] + len(new))
        ctx.append(seq.seen_tokens + len(new))
    width = max(len(s.blocks) for s in sequences)
    table = [s.blocks + [0] * (width - len(s.blocks)) for s in sequences]
    return {"ids": ids, "positions": positions, "slots": slots, "cu": cu, "ctx": ctx, "table": table,
            "last": [c - 1 for c in cu[1:]]}  # fmt: skip


def mixed_batch() -> tuple[list[SequenceDescriptor], list[list[int]]]:
    sequences = [
        SequenceDescriptor(uid=7, blocks=[9, 2, 5], seen_tokens=6),  # 3 new: a chunk crossing a block edge
        SequenceDescriptor(uid=8, blocks=[0], seen_tokens=0),  # a fresh prompt of 4
        SequenceDescriptor(uid=9, blocks=[3, 1], seen_tokens=7),  # one decode token
    ]
    return sequences, [[11, 12, 13], [21, 22, 23, 24], [31]]


def test_build_matches_the_token_by_token_metadata() -> None:
    sequences, tokens = mixed_batch()
    batch = RaggedBatch.build(sequences, tokens, BLOCK, torch.device("cpu"))
    want = naive(sequences, tokens)
    m = batch.meta
    assert batch.input_ids.tolist() == want["ids"] and batch.input_ids.dtype == torch.int64
    assert m.positions.tolist() == want["positions"]
    assert (
        m.slot_mapping.tolist()
        == want["slots"]
        == [2 * BLOCK + 2, 2 * BLOCK + 3, 5 * BLOCK, 0, 1, 2, 3, 4 + 3]
    )
    assert m.cu_q_lens.tolist() == want["cu"] and m.cu_q_lens.dtype == torch.int32
    assert m.context_lens.tolist() == want["ctx"] == [9, 4, 8]
    assert m.block_table.tolist() == want["table"] and m.block_table.dtype == torch.int32
    assert m.last_token_indices.tolist() == want["last"]
    assert (m.max_q_len, m.max_context_len, m.num_seqs, batch.num_tokens) == (4, 9, 3, 8)
    assert m.num_decode_seqs == 0  # the decode row is not among the leading ones


def test_leading_decode_rows_are_counted() -> None:
    """``num_decode_seqs``: the single-token sequences before the first longer one (the scheduler
    puts decodes first, so a mixed batch's attention can send them to the decode kernel)."""
    sequences, _ = mixed_batch()
    order = [2, 2, 0, 1]  # the decode row twice (as two sequences), then the chunk and the prompt
    sequences = [sequences[i] for i in order]
    for new, want in (([[31], [32], [11, 12, 13], [21, 22, 23, 24]]), 2), (([[31], [32], [11], [21]]), 4):
        assert pack_batch(sequences, new, BLOCK).num_decode_seqs == want
        batch = RaggedBatch.build(sequences, new, BLOCK, torch.device("cpu"))
        assert batch.meta.num_decode_seqs == want


def test_padding_to_a_rung_adds_inert_rows() -> None:
    sequences = [
        SequenceDescriptor(uid=1, blocks=[4, 6], seen_tokens=5),
        SequenceDescriptor(uid=2, blocks=[8], seen_tokens=2),
    ]
    tokens = [[101], [102]]
    packed = pack_batch(sequences, tokens, BLOCK, num_seqs=4, table_width=5)
    batch = packed.layout.views(torch.from_numpy(packed.data), packed.max_q_len, packed.max_context_len)
    m = batch.meta
    assert batch.input_ids.tolist() == [101, 102, 0, 0]
    assert m.positions.tolist() == [5, 2, 0, 0]
    assert m.slot_mapping.tolist() == [6 * BLOCK + 1, 8 * BLOCK + 2, -1, -1]  # padding writes nothing
    assert m.cu_q_lens.tolist() == [0, 1, 2, 2, 2]  # padded sequences own no token
    assert m.context_lens.tolist() == [6, 3, 0, 0]
    assert m.block_table.tolist() == [[4, 6, 0, 0, 0], [8, 0, 0, 0, 0], [0] * 5, [0] * 5]
    assert m.last_token_indices.tolist() == [0, 1, 2, 3]
    assert (packed.max_q_len, packed.max_context_len) == (1, 6)


def test_an_all_padding_batch_is_valid() -> None:
    packed = pack_batch([], [], BLOCK, num_seqs=2, table_width=3)
    batch = packed.layout.views(torch.from_numpy(packed.data), 1, 12)
    assert batch.meta.slot_mapping.tolist() == [-1, -1]
    assert batch.meta.cu_q_lens.tolist() == [0, 0, 0]


def test_padding_smaller_than_the_batch_is_refused() -> None:
    sequences, tokens = mixed_batch()
    try:
        pack_batch(sequences, tokens, BLOCK, table_width=2)
    except ValueError as err:
        assert "cannot pad" in str(err)
    else:
        raise AssertionError("a table narrower than a sequence's blocks must be refused")


def test_staging_reuses_one_buffer_and_copies_into_a_given_tensor() -> None:
    sequences, tokens = mixed_batch()
    staging = HostStaging(torch.device("cpu"))
    packed = pack_batch(sequences, tokens, BLOCK)
    out = torch.zeros(packed.layout.nbytes + 8, dtype=torch.uint8)
    assert staging.upload(packed, out=out) is out
    assert out[: packed.layout.nbytes].numpy().tobytes() == packed.data.tobytes()
    before = packed.data.copy()
    fresh = staging.upload(packed)
    fresh.fill_(7)  # a fresh upload owns its memory: the packed host bytes are untouched
    assert (packed.data == before).all()
