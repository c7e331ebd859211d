"""Scheduler: token budget, sequence cap, decode before prompt chunks, admission only when the KV
cache holds the prompt, and preemption that frees blocks and loses nothing."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.batching.executor import LocalExecutor, run_step
from mii_server.batching.request import Request, RequestStatus, RequestUpdate
from mii_server.batching.scheduler import Scheduler
from mii_server.batching.step import Step
from mii_server.engine import InferenceEngine
from mii_server.engine.prefix_cache import BlockBudget
from mii_server.generation.detokenizer import IncrementalDetokenizer
from mii_server.generation.params import GenerateParams
from mii_server.in_process import Pipeline

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "A model server answers requests for text; ragged batching packs many sequences",
    "Numbers 0 1 2 3",
    "Deployments have replicas, a load balancer and a REST gateway.",
]
NEW_TOKENS = 12
GREEDY = GenerateParams(max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True)


@dataclass
class StepRecord:
    step: Step
    prompt_entries: list[bool]  # per batch entry: True when it feeds prompt tokens, False for a decode
    held_after_flush: dict[int, int]  # blocks each flushed uid holds once the step ran


@dataclass
class RecordingExecutor:
    """Runs steps like LocalExecutor and records what each one asked of the engine."""

    engine: InferenceEngine
    prompt_lengths: dict[int, int] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)

    def execute(self, step: Step) -> torch.Tensor | None:
        for uid in step.flush_uids:
            self.engine.flush(uid)
        prompt_entries = [self.engine.seen_tokens(uid) < self.prompt_lengths[uid] for uid in step.uids]
        logits = run_step(self.engine, replace(step, flush_uids=[]))
        held = {uid: self.engine.blocks_held(uid) for uid in step.flush_uids}
        self.records.append(StepRecord(step, prompt_entries, held))
        return logits

    def close(self) -> None:
        pass


def run_recorded(pipe: Pipeline, prompts: list[str]) -> tuple[list[list[int]], list[StepRecord], list[str]]:
    """Submit ``prompts`` to ``pipe``'s loop, step it dry; returns tokens, step records, finish reasons."""
    loop = pipe.loop
    assert loop is not None
    recorder = RecordingExecutor(loop.engine)
    loop.executor = recorder
    updates: dict[int, list[RequestUpdate]] = {}
    uids = []
    for prompt in prompts:
        uid = loop.submit(prompt, GREEDY, lambda u: updates[u.uid].append(u))
        updates[uid] = []
        recorder.prompt_lengths[uid] = len(loop.tokenizer.encode(prompt))
        uids.append(uid)
    while loop.has_work():
        loop.step()
    loop.executor = LocalExecutor(loop.engine)
    tokens = [[t for u in updates[uid] for t in u.response.token_ids] for uid in uids]
    reasons = [updates[uid][-1].response.finish_reason.value for uid in uids]
    return tokens, recorder.records, reasons


@pytest.fixture(scope="module")
def reference(tiny_checkpoints: dict[str, Path]) -> list[list[int]]:
    pipe = mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 16, "num_blocks": 64})
    out = [r.token_ids for r in pipe(PROMPTS, **GREEDY.model_dump())]
    pipe.destroy()
    return out


def test_token_budget_sequence_cap_and_decode_first(
    tiny_checkpoints: dict[str, Path], reference: list[list[int]]
) -> None:
    pipe = mii_server.pipeline(
        str(tiny_checkpoints["llama"]),
        kv_cache={"block_size": 4, "num_blocks": 64},
        max_ragged_batch_size=8,
        max_ragged_sequence_count=3,
    )
    tokens, records, reasons = run_recorded(pipe, PROMPTS)
    assert tokens == reference
    assert reasons == ["length"] * len(PROMPTS)
    for rec in records:
        assert rec.step.num_tokens <= 8
        assert len(rec.step.uids) <= 3
        # Decode entries (one generated token each) come before every prompt chunk.
        assert rec.prompt_entries == sorted(rec.prompt_entries)  # False (decode) < True (prompt)
        for is_prompt, chunk in zip(rec.prompt_entries, rec.step.tokens):
            assert is_prompt or len(chunk) == 1
    # The scenario really mixed decodes with prompt chunks and split prompts across forwards.
    assert any(True in r.prompt_entries and False in r.prompt_entries for r in records)
    assert any(r.step.num_tokens == 8 for r in records)  # the budget was filled
    prompt_chunks = [u for r in records for u, p in zip(r.step.uids, r.prompt_entries) if p]
    assert max(prompt_chunks.count(uid) for uid in set(prompt_chunks)) > 1  # a prompt split across forwards
    assert pipe.loop.engine.free_blocks == pipe.loop.engine.total_blocks
    pipe.destroy()


def test_preemption_frees_blocks_and_finishes_with_identical_tokens(
    tiny_checkpoints: dict[str, Path], reference: list[list[int]]
) -> None:
    pipe = mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 4, "num_blocks": 14})
    tokens, records, reasons = run_recorded(pipe, PROMPTS)
    loop = pipe.loop
    assert loop.scheduler.num_preemptions > 0
    assert tokens == reference
    assert reasons == ["length"] * len(PROMPTS)
    # A preempted request is flushed, then runs again from its first token.
    rerun = [
        uid
        for i, rec in enumerate(records)
        for uid in rec.step.flush_uids
        if any(uid in later.step.uids for later in records[i + 1 :])
    ]
    assert rerun
    for rec in records:
        assert all(held == 0 for held in rec.held_after_flush.values())
    assert loop.engine.free_blocks == loop.engine.total_blocks
    assert not loop.has_work()
    pipe.destroy()


# ---- admission, on a fake view of the KV cache ------------------------------------------------


@dataclass
class FakeBlocks:
    block_size: int
    total_blocks: int
    free_blocks: int
    held: dict[int, int] = field(default_factory=dict)

    def blocks_held(self, uid: int) -> int:
        return self.held.get(uid, 0)

    def block_budget(self) -> BlockBudget:  # no sharing: every held block has one reference
        blocks_of = lambda uid: [uid * 1000 + i for i in range(self.blocks_held(uid))]
        return BlockBudget(self.free_blocks, refcount=lambda block: 1, blocks_of=blocks_of, match=lambda h: [])


def make_request(uid: int, prompt_len: int, params: GenerateParams = GREEDY) -> Request:
    ids = list(range(1, prompt_len + 1))
    return Request(
        uid=uid,
        prompt_ids=ids,
        params=params,
        max_new_tokens=NEW_TOKENS,
        stop_ids=frozenset(),
        detokenizer=IncrementalDetokenizer(None, ids),
        generator=None,
        sink=lambda update: None,
    )


def test_admits_a_prompt_only_when_the_cache_holds_it() -> None:
    blocks = FakeBlocks(block_size=4, total_blocks=10, free_blocks=2)
    sched = Scheduler(blocks, max_batch_tokens=5, max_batch_sequences=4, max_tracked_sequences=8)
    big, small = make_request(0, 12), make_request(1, 2)  # 3 blocks, then 1 block
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.step.uids == [] and out.requests == []
    assert list(sched.waiting) == [big, small]  # FIFO: the small one does not jump the queue
    assert big.status is RequestStatus.WAITING
    blocks.free_blocks = 3
    out = sched.schedule()
    # Admitted although only a 5-token chunk fits the budget: the cache holds the whole prompt.
    assert out.step.uids == [0] and out.step.tokens == [[1, 2, 3, 4, 5]]
    assert big.status is RequestStatus.RUNNING and list(sched.waiting) == [small]


def test_sequence_cap_limits_admission() -> None:
    blocks = FakeBlocks(block_size=4, total_blocks=100, free_blocks=100)
    sched = Scheduler(blocks, max_batch_tokens=100, max_batch_sequences=2, max_tracked_sequences=3)
    requests = [make_request(i, 3) for i in range(5)]
    for req in requests:
        sched.add(req)
    out = sched.schedule()
    assert out.step.uids == [0, 1]  # max_ragged_sequence_count: two per forward
    for req in out.requests:  # as if the step ran: prompts in the cache, no token sampled yet
        req.num_computed_tokens = req.num_tokens
    assert sched.schedule().step.uids == [2]  # max_tracked_sequences: three running at most
    assert [r.uid for r in sched.waiting] == [3, 4]


def test_prompt_logprobs_chunks_fit_the_logit_row_cap() -> None:
    """A request asking for prompt log-probabilities gets a logits row per prompt token; a step holds
    at most max_batch_sequences rows, so its prompt is cut into chunks of that many."""
    blocks = FakeBlocks(block_size=4, total_blocks=100, free_blocks=100)
    sched = Scheduler(blocks, max_batch_tokens=100, max_batch_sequences=4, max_tracked_sequences=8)
    scoring = make_request(0, 10, GenerateParams(max_new_tokens=2, do_sample=False, prompt_logprobs=1))
    plain = make_request(1, 6)
    sched.add(scoring)
    sched.add(plain)
    out = sched.schedule()
    assert out.step.uids == [0] and out.step.tokens == [[1, 2, 3, 4]] and out.step.full_logits == [0]
    scoring.num_computed_tokens += 4
    scoring.prompt_logprobs_queued(4)  # what the loop does once the logits are in
    out = sched.schedule()
    # 4 more rows for the scoring prompt leave none for the plain one (which needs one row)
    assert out.step.uids == [0] and out.step.tokens == [[5, 6, 7, 8]] and out.step.full_logits == [0]
    scoring.num_computed_tokens += 4
    scoring.prompt_logprobs_queued(8)
    out = sched.schedule()
    # positions 8 and 9: row 8 predicts the last prompt token, row 9 the first output token
    assert out.step.uids == [0, 1] and out.step.full_logits == [0]
    assert out.step.tokens == [[9, 10], [1, 2, 3, 4, 5, 6]]
    scoring.prompt_logprobs_queued(9)
    assert not scoring.full_logits_pending
