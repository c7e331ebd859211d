"""InferenceEngine: put / query / can_schedule / flush against Hugging Face logits; over-commit is
reported with CapacityExceeded and leaves the engine exactly as it was."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mii_server.config import ModelConfig
from mii_server.engine import InferenceEngine, SchedulingResult
from mii_server.errors import CapacityExceeded
from mii_server.runtime import build_runtime

BLOCK_SIZE = 4
NUM_BLOCKS = 16
MAX_TOKENS = 32  # max_ragged_batch_size
MAX_SEQS = 4  # max_ragged_sequence_count
MAX_TRACKED = 6


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, Path]) -> InferenceEngine:
    config = ModelConfig.from_kwargs(
        str(tiny_checkpoints["llama"]),
        kv_cache={"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS},
        max_ragged_batch_size=MAX_TOKENS,
        max_ragged_sequence_count=MAX_SEQS,
        max_tracked_sequences=MAX_TRACKED,
    )
    return build_runtime(config).engine


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoints: dict[str, Path]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["llama"]), dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def clean_engine(engine: InferenceEngine) -> Iterator[None]:
    yield
    for uid in list(range(100)):
        engine.flush(uid)
    assert engine.free_blocks == NUM_BLOCKS


def hf_last_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


def put(engine: InferenceEngine, uids: list[int], tokens: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return engine.put(uids, tokens)


SEQ_A = [5, 17, 33, 100, 7]
SEQ_B = [250, 3, 3, 9, 41, 60, 61, 62, 200]


def test_put_returns_one_logits_row_per_sequence(engine: InferenceEngine, hf_model: Any) -> None:
    logits = put(engine, [10, 11], [SEQ_A, SEQ_B])
    assert logits.shape == (2, hf_model.config.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, SEQ_A), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(hf_model, SEQ_B), atol=1e-4, rtol=1e-4)
    assert engine.seen_tokens(10) == 5 and engine.seen_tokens(11) == 9
    assert engine.blocks_held(10) == 2 and engine.blocks_held(11) == 3
    assert engine.free_blocks == NUM_BLOCKS - 5
    # A decode step for both, in the other order.
    logits = put(engine, [11, 10], [[77], [88]])
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, SEQ_B + [77]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(hf_model, SEQ_A + [88]), atol=1e-4, rtol=1e-4)
    assert engine.blocks_held(11) == 3  # token 10 of B fits in its third block


def test_prompt_fed_in_chunks_equals_whole(engine: InferenceEngine, hf_model: Any) -> None:
    put(engine, [1], [SEQ_B[:3]])
    put(engine, [1, 2], [SEQ_B[3:7], SEQ_A])  # a chunk beside a new sequence
    logits = put(engine, [1], [SEQ_B[7:]])
    assert logits.shape[0] == 1
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, SEQ_B), atol=1e-4, rtol=1e-4)


def test_flush_frees_blocks_and_forgets(engine: InferenceEngine) -> None:
    put(engine, [3, 4], [SEQ_A, SEQ_B])
    engine.flush(3)
    assert engine.free_blocks == NUM_BLOCKS - 3
    assert engine.seen_tokens(3) == 0 and engine.blocks_held(3) == 0
    engine.flush(3)  # unknown uid: a no-op
    engine.flush(99)
    assert engine.free_blocks == NUM_BLOCKS - 3


def test_can_schedule_reports_each_result(engine: InferenceEngine) -> None:
    ok = SchedulingResult.Success
    assert engine.can_schedule([1, 2], [5, 9]) is ok
    assert engine.can_schedule([1, 2, 3, 4, 5], [1] * 5) is SchedulingResult.BatchSequenceLimitExceeded
    assert engine.can_schedule([1], [MAX_TOKENS]) is ok
    assert engine.can_schedule([1], [MAX_TOKENS + 1]) is SchedulingResult.BatchTokenLimitExceeded
    # Fill 12 of 16 blocks: 3 sequences of 16 tokens.
    put(engine, [1, 2], [list(range(16)), list(range(16))])
    put(engine, [3], [list(range(16))])
    assert engine.free_blocks == 4
    assert engine.can_schedule([4], [16]) is ok
    assert engine.can_schedule([4], [17]) is SchedulingResult.KVCacheLimitExceeded
    assert engine.can_schedule([1, 4], [1, 16]) is SchedulingResult.KVCacheLimitExceeded
    # Sequence cap of the engine: 6 tracked at most.
    put(engine, [4, 5, 6], [[1], [2], [3]])
    assert engine.free_blocks == 1
    assert engine.can_schedule([7], [1]) is SchedulingResult.EngineSequenceLimitExceeded
    assert engine.can_schedule([4], [3]) is ok  # live sequences, room in their block
    assert engine.can_schedule([4, 5], [4, 4]) is SchedulingResult.KVCacheLimitExceeded


def engine_state(engine: InferenceEngine) -> tuple[int, int, dict[int, tuple[int, int]]]:
    live = {
        uid: (engine.seen_tokens(uid), engine.blocks_held(uid)) for uid in range(20) if uid in engine.state
    }
    return engine.free_blocks, len(engine.state), live


@pytest.mark.parametrize(
    "uids, lengths, reason",
    [
        ([1, 2, 3, 20, 21], [1, 1, 1, 1, 1], "BatchSequenceLimitExceeded"),
        ([1, 20], [1, MAX_TOKENS], "BatchTokenLimitExceeded"),
        ([20], [5 * BLOCK_SIZE + 1], "KVCacheLimitExceeded"),
        ([1, 2], [3 * BLOCK_SIZE, 3 * BLOCK_SIZE], "KVCacheLimitExceeded"),  # 3 + 3 more blocks
    ],
)
def test_over_commit_raises_and_leaves_state_untouched(
    engine: InferenceEngine, hf_model: Any, uids: list[int], lengths: list[int], reason: str
) -> None:
    put(engine, [1, 2], [SEQ_A, SEQ_B])  # 2 + 3 blocks
    put(engine, [3], [list(range(20))])  # 5 blocks
    put(engine, [1, 2, 3], [[9], [9], list(range(4))])  # 6, 10, 24 tokens in 2 + 3 + 6 blocks
    before = engine_state(engine)
    assert before[0] == 5
    with pytest.raises(CapacityExceeded, match=reason):
        put(engine, uids, [[7] * n for n in lengths])
    assert engine_state(engine) == before
    # The engine still computes correctly afterwards.
    logits = put(engine, [1, 2], [[42], [43]])
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, SEQ_A + [9, 42]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_last_logits(hf_model, SEQ_B + [9, 43]), atol=1e-4, rtol=1e-4)


def test_over_commit_of_tracked_sequences_raises_and_leaves_state_untouched(
    engine: InferenceEngine, hf_model: Any
) -> None:
    put(engine, [0, 1, 2, 3], [[1], [2], [3], SEQ_A])
    put(engine, [4, 5], [[5], [6]])
    before = engine_state(engine)
    with pytest.raises(CapacityExceeded, match="EngineSequenceLimitExceeded"):
        put(engine, [3, 6], [[8], [1]])
    assert engine_state(engine) == before
    logits = put(engine, [3], [[8]])
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, SEQ_A + [8]), atol=1e-4, rtol=1e-4)


def test_put_rejects_malformed_batches(engine: InferenceEngine) -> None:
    for uids, tokens in [([], []), ([1], [[1], [2]]), ([1, 1], [[1], [2]]), ([1], [[]])]:
        with pytest.raises(ValueError):
            put(engine, uids, tokens)
    assert engine.free_blocks == NUM_BLOCKS and len(engine.state) == 0


def test_query(engine: InferenceEngine) -> None:
    assert engine.query(9, 10, 2) == (8, 2)  # unknown uid: a new sequence
    assert engine.query(9, 3, 2) == (3, 1)
    assert engine.query(9, 10, 0) == (0, 0)
    put(engine, [9], [SEQ_A])  # 5 tokens in 2 blocks: 3 free slots
    assert engine.query(9, 10, 0) == (3, 0)
    assert engine.query(9, 2, 0) == (2, 0)
    assert engine.query(9, 10, 1) == (7, 1)
    assert engine.query(9, 4, 5) == (4, 1)
    assert engine.query(9, 100, 3) == (15, 3)
