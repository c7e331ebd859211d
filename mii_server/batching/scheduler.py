"""Scheduler: builds each Step under the token budget (Dynamic SplitFuse), admits what the KV cache
can hold, and preempts (free now, recompute later) when the cache runs dry. Plain Python, no torch.

Policy, oldest first: decode tokens of running requests, then the next chunks of prompts being
filled, then new prompts. A request that cannot get blocks preempts the youngest running request
not yet in this step (or itself), so the oldest request always progresses and nothing is lost.

Prefix caching (when the engine shares blocks by content): a request being admitted starts from the
longest run of its full blocks the cache holds (never all of its tokens: the last one is computed
to get logits), and every block that fills up is registered for later requests. Both travel in the
Step, so tensor-parallel followers keep the same cache. Requests that ask for prompt
log-probabilities reuse nothing (they need the logits of every prompt token).

Logit rows: a forward returns one row of logits per sequence, or one per new token for a request
whose prompt log-probabilities are being computed; a step holds at most ``max_batch_sequences``
rows, the size the engine's memory was measured for.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ..engine.prefix_cache import BlockBudget, chain_hashes
from ..engine.state_manager import blocks_for
from .request import Request, RequestStatus
from .step import Step


class BlockView(Protocol):
    """What the scheduler reads of the engine's KV accounting."""

    block_size: int

    def blocks_held(self, uid: int) -> int: ...

    def block_budget(self) -> BlockBudget: ...


@dataclass
class ScheduledStep:
    """A Step plus rank 0's bookkeeping for it."""

    step: Step
    requests: list[Request] = field(default_factory=list)  # in batch order, one per step.uids entry
    preempted: list[Request] = field(default_factory=list)  # sent back to the waiting queue


class Scheduler:
    def __init__(
        self,
        blocks: BlockView,
        max_batch_tokens: int,
        max_batch_sequences: int,
        max_tracked_sequences: int,
        prefix_caching: bool = False,
    ) -> None:
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sequences = max_batch_sequences
        self.max_tracked_sequences = max_tracked_sequences
        self.prefix_caching = prefix_caching  # the engine shares blocks by content
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, oldest (smallest uid) first
        self._pending_flush: list[int] = []
        self.num_preemptions = 0
        self.cached_prompt_tokens = 0  # prompt tokens admitted from the prefix cache, since start

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_flush)

    def finish(self, request: Request) -> None:
        """Take a finished or aborted request out; its blocks are freed at the next step."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._pending_flush.append(request.uid)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    def schedule(self) -> ScheduledStep:
        flush = self._pending_flush
        self._pending_flush = []
        budget = self.blocks.block_budget()
        for uid in flush:
            budget.release(uid)
        out = ScheduledStep(Step(flush_uids=flush))
        tokens_left = self.max_batch_tokens
        rows_left = self.max_batch_sequences  # logit rows (one per entry, unless it wants full logits)
        chosen: set[int] = set()

        def chunk(req: Request) -> tuple[int, bool]:
            """(tokens to feed ``req`` now, whether they all need logits)."""
            n = min(req.num_pending_tokens, tokens_left)
            if not req.full_logits_pending or not req.wants_full_logits(n):
                return n, False
            n = min(n, rows_left)
            return n, req.wants_full_logits(n)

        def take(req: Request, n: int, full: bool) -> None:
            nonlocal tokens_left, rows_left
            start = req.num_computed_tokens
            if full:
                out.step.full_logits.append(len(out.step.uids))
            out.step.uids.append(req.uid)
            out.step.tokens.append(req.token_slice(start, n))
            out.requests.append(req)
            chosen.add(req.uid)
            tokens_left -= n
            rows_left -= n if full else 1

        decodes = [r for r in self.running if r.num_pending_tokens == 1]
        fills = [r for r in self.running if r.num_pending_tokens > 1]
        for req in decodes + fills:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if tokens_left == 0 or rows_left == 0:
                break
            n, full = chunk(req)
            need = self._blocks_needed(req, n)
            while need > budget.free:
                victim = self._youngest_unscheduled(chosen) or req
                self._preempt(victim, out)
                budget.release(victim.uid)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            if need:
                budget.take(need)
            take(req, n, full)

        # New prompts (FIFO) only while nobody is being preempted, so the freed room goes to the
        # requests that were already running.
        bs = self.blocks.block_size
        while not out.preempted and self.waiting and tokens_left and rows_left:
            req = self.waiting[0]
            if len(self.running) >= self.max_tracked_sequences or not req.num_pending_tokens:
                break  # (nothing pending: preempted with its last token in flight; it finishes next)
            hashes = self._reusable_hashes(req)
            hits, revived = budget.prefix(hashes)
            if revived + blocks_for(req.num_tokens, bs) - hits > budget.free:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            # insort, not append + sort: list.sort empties the list while it runs, and stats are
            # read from other threads
            bisect.insort(self.running, req, key=lambda r: r.uid)
            if hits:
                budget.reuse(hashes[:hits])
                out.step.cached_prefix.append((req.uid, hashes[:hits]))
                req.num_computed_tokens = hits * bs
            req.num_registered_blocks = hits
            if req.num_cached_tokens is None:  # first admission: report what the prompt reused
                req.num_cached_tokens = hits * bs
                self.cached_prompt_tokens += hits * bs
            n, full = chunk(req)
            budget.take(blocks_for(req.num_computed_tokens + n, bs) - hits)
            take(req, n, full)
        self._return_preempted(out.preempted)
        if self.prefix_caching:
            self._register_filled_blocks(out)
        return out

    def _reusable_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the blocks ``req`` may take from the cache: its full blocks of known tokens,
        short of its last token (whose logits are needed)."""
        if not self.prefix_caching or req.params.prompt_logprobs is not None:
            return []
        limit = (req.num_tokens - 1) // self.blocks.block_size
        self._hash_blocks(req, limit)
        return req.block_hashes[:limit]

    def _hash_blocks(self, req: Request, blocks: int) -> None:
        """Extend ``req.block_hashes`` to its first ``blocks`` blocks, as far as its tokens are known
        on the host (not a token still in flight)."""
        bs = self.blocks.block_size
        have = len(req.block_hashes)
        upto = min(blocks, req.num_known_tokens // bs)
        if upto > have:
            parent = req.block_hashes[-1] if have else b""
            req.block_hashes.extend(chain_hashes(req.token_slice(have * bs, (upto - have) * bs), bs, parent))

    def _register_filled_blocks(self, out: ScheduledStep) -> None:
        """Name, in the Step, the blocks this step fills whose every token is known."""
        bs = self.blocks.block_size
        for req, tokens in zip(out.requests, out.step.tokens):
            full = (req.num_computed_tokens + len(tokens)) // bs
            if full <= req.num_registered_blocks:
                continue  # (most decode steps: no block fills up)
            full = min(full, req.num_known_tokens // bs)
            if full > req.num_registered_blocks:
                self._hash_blocks(req, full)
                first = req.num_registered_blocks
                out.step.register.append((req.uid, first, req.block_hashes[first:full]))
                req.num_registered_blocks = full

    def _blocks_needed(self, req: Request, n: int) -> int:
        have = self.blocks.blocks_held(req.uid)
        return max(0, blocks_for(req.num_computed_tokens + n, self.blocks.block_size) - have)

    def _youngest_unscheduled(self, chosen: set[int]) -> Request | None:
        for req in reversed(self.running):
            if req.uid not in chosen:
                return req
        return None

    def _preempt(self, req: Request, out: ScheduledStep) -> None:
        """Drop ``req``'s KV (recomputed, or taken from the prefix cache, when it is admitted again)."""
        self.running.remove(req)
        out.step.flush_uids.append(req.uid)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        out.preempted.append(req)
        self.num_preemptions += 1

    def _return_preempted(self, preempted: list[Request]) -> None:
        # Back to the front of the queue, oldest first, ahead of requests that never ran.
        for req in sorted(preempted, key=lambda r: r.uid, reverse=True):
            self.waiting.appendleft(req)
