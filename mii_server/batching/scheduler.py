"""Scheduler: builds each Step under the token budget (Dynamic SplitFuse), admits what the KV cache
can hold, and preempts (free now, recompute later) when the cache runs dry. Plain Python, no torch.

Policy, oldest first: decode tokens of running requests, then the next chunks of prompts being
filled, then new prompts. A request that cannot get blocks preempts the youngest running request
not yet in this step (or itself), so the oldest request always progresses and nothing is lost.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ..engine.state_manager import blocks_for
from .request import Request, RequestStatus
from .step import Step


class BlockView(Protocol):
    """What the scheduler reads of the engine's KV accounting."""

    block_size: int

    @property
    def free_blocks(self) -> int: ...

    @property
    def total_blocks(self) -> int: ...

    def blocks_held(self, uid: int) -> int: ...


@dataclass
class ScheduledStep:
    """A Step plus rank 0's bookkeeping for it."""

    step: Step
    requests: list[Request] = field(default_factory=list)  # in batch order, one per step.uids entry
    preempted: list[Request] = field(default_factory=list)  # sent back to the waiting queue


class Scheduler:
    def __init__(
        self, blocks: BlockView, max_batch_tokens: int, max_batch_sequences: int, max_tracked_sequences: int
    ) -> None:
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sequences = max_batch_sequences
        self.max_tracked_sequences = max_tracked_sequences
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, oldest (smallest uid) first
        self._pending_flush: list[int] = []
        self.num_preemptions = 0

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
        free = self.blocks.free_blocks + sum(self.blocks.blocks_held(uid) for uid in flush)
        out = ScheduledStep(Step(flush_uids=flush))
        tokens_left = self.max_batch_tokens
        chosen: set[int] = set()

        def take(req: Request, n: int) -> None:
            nonlocal tokens_left
            start = req.num_computed_tokens
            out.step.uids.append(req.uid)
            out.step.tokens.append(req.token_slice(start, n))
            out.requests.append(req)
            chosen.add(req.uid)
            tokens_left -= n

        decodes = [r for r in self.running if r.num_pending_tokens == 1]
        fills = [r for r in self.running if r.num_pending_tokens > 1]
        for req in decodes + fills:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if tokens_left == 0 or len(out.requests) == self.max_batch_sequences:
                break
            n = min(req.num_pending_tokens, tokens_left)
            need = self._blocks_needed(req, n)
            while need > free:
                victim = self._youngest_unscheduled(chosen) or req
                free += self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            free -= need
            take(req, n)

        # New prompts (FIFO) only while nobody is being preempted, so the freed room goes to the
        # requests that were already running.
        while not out.preempted and self.waiting and tokens_left and len(out.requests) < self.max_batch_sequences:
            req = self.waiting[0]
            if len(self.running) >= self.max_tracked_sequences or not req.num_pending_tokens:
                break  # (nothing pending: preempted with its last token in flight; it finishes next)
            if blocks_for(req.num_pending_tokens, self.blocks.block_size) > free:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            # insort, not append + sort: list.sort empties the list while it runs, and stats are
            # read from other threads
            bisect.insort(self.running, req, key=lambda r: r.uid)
            n = min(req.num_pending_tokens, tokens_left)
            free -= self._blocks_needed(req, n)
            take(req, n)
        self._return_preempted(out.preempted)
        return out

    def _blocks_needed(self, req: Request, n: int) -> int:
        have = self.blocks.blocks_held(req.uid)
        return max(0, blocks_for(req.num_computed_tokens + n, self.blocks.block_size) - have)

    def _youngest_unscheduled(self, chosen: set[int]) -> Request | None:
        for req in reversed(self.running):
            if req.uid not in chosen:
                return req
        return None

    def _preempt(self, req: Request, out: ScheduledStep) -> int:
        """Drop ``req``'s KV (recomputed when it is admitted again); returns the blocks freed."""
        freed = self.blocks.blocks_held(req.uid)
        self.running.remove(req)
        out.step.flush_uids.append(req.uid)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        out.preempted.append(req)
        self.num_preemptions += 1
        return freed

    def _return_preempted(self, preempted: list[Request]) -> None:
        # Back to the front of the queue, oldest first, ahead of requests that never ran.
        for req in sorted(preempted, key=lambda r: r.uid, reverse=True):
            self.waiting.appendleft(req)
