"""GenerationLoop: one iteration = schedule, execute (flush + feed), sample, emit updates.

Thread-safe at its edges: ``submit`` and ``abort`` may be called from any thread; ``step`` runs on
one thread (the pipeline's caller or the replica's batching thread).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.state_manager import blocks_for
from ..errors import InvalidRequest
from ..generation.detokenizer import IncrementalDetokenizer
from ..generation.params import GenerateParams
from ..generation.sampler import sample_on_device, to_device
from ..wire.types import EngineStats
from .executor import StepExecutor
from .request import Request, RequestStatus, RequestUpdate, Sink
from .scheduler import ScheduledStep, Scheduler
from .step import fed_back_placeholder

log = logging.getLogger(__name__)


class _HostCopy:
    """Sampled ids on their way to the host: the copy is queued behind the forward and waited for
    only when the ids are needed."""

    def __init__(self, ids: torch.Tensor) -> None:
        if ids.device.type == "cuda":
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = ids, None

    def wait(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


@dataclass
class _SampledStep:
    """A launched step that sampled ``requests`` (in row order); their ids arrive through ``ids``."""

    requests: list[Request]
    ids: _HostCopy


class GenerationLoop:
    """Runs the batching loop over one engine.

    ``overlap``: queue step N+1 before reading back step N's sampled ids, so the host's scheduling
    and bookkeeping run while the device computes. Step N+1 feeds N's tokens from the device
    (placeholders in its token lists, see ``Step.tokens``), so this needs an executor whose every
    rank sees the sampled ids: one rank (``LocalExecutor.feeds_back``). A request that stops on a
    token of step N has one more token computed in N+1, which is discarded.
    """

    def __init__(
        self,
        executor: StepExecutor,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        context_length: int,
        default_max_length: int,
        max_batch_tokens: int,
        max_batch_sequences: int,
        max_tracked_sequences: int,
        seed: int = 0,
        overlap: bool = True,
    ) -> None:
        self.executor = executor
        self.overlap = overlap and executor.feeds_back
        self._in_flight: _SampledStep | None = None  # launched, ids not read back yet (overlap only)
        self.engine = executor.engine
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.default_max_length = default_max_length
        self.scheduler = Scheduler(self.engine, max_batch_tokens, max_batch_sequences, max_tracked_sequences)
        self._uids = itertools.count()
        self._seed = seed
        self._lock = threading.Lock()  # guards the inbox, the abort list and the tokenizer
        self._inbox: list[Request] = []
        self._aborts: list[int] = []
        self._live: dict[int, Request] = {}  # touched by the stepping thread only
        self._wakeup = threading.Condition(self._lock)
        self.requests_finished = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0

    # ---- any thread ----------------------------------------------------------------------------

    def prepare(self, prompt: str | list[int], params: GenerateParams, sink: Sink, stream: bool = True) -> Request:
        """Tokenise and validate one prompt; raises InvalidRequest. Nothing is queued yet.

        ``stream``: updates carry text as it is generated; otherwise (and unless stop strings must be
        watched) the text is decoded once, into the final update.
        """
        with self._lock:
            uid = next(self._uids)
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
                text = prompt
            else:
                ids, text = list(prompt), self.tokenizer.decode(list(prompt))
        if not ids:
            raise InvalidRequest("the prompt is empty (no tokens)")
        max_new = params.limits_for(len(ids), self.default_max_length, self.context_length)
        need = blocks_for(len(ids) + max_new, self.engine.block_size)
        if need > self.engine.total_blocks:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) plus up to {max_new} new tokens needs {need} KV blocks, but the "
                f"cache holds {self.engine.total_blocks}; lower max_new_tokens or give the cache more memory"
            )
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        generator = None
        if params.do_sample:
            generator = torch.Generator(device=self.engine.device)
            generator.manual_seed(params.seed if params.seed is not None else self._seed * 1_000_003 + uid)
        return Request(
            uid=uid,
            prompt_ids=ids,
            params=params,
            max_new_tokens=max_new,
            stop_ids=stop_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
            generator=generator,
            sink=sink,
            prompt_text=text,
            incremental_text=stream or bool(params.stop),
        )

    def enqueue(self, requests: list[Request]) -> None:
        with self._lock:
            self._inbox.extend(requests)
            self._wakeup.notify()

    def submit(self, prompt: str | list[int], params: GenerateParams, sink: Sink, stream: bool = True) -> int:
        request = self.prepare(prompt, params, sink, stream)
        self.enqueue([request])
        return request.uid

    def abort(self, uid: int) -> None:
        """Stop ``uid`` at the next step; its sink gets a final ABORT update and its blocks are freed."""
        with self._lock:
            self._aborts.append(uid)
            self._wakeup.notify()

    def wait_for_work(self, timeout: float | None = None) -> None:
        """Block until something is queued (for an idle batching thread)."""
        with self._lock:
            if not (self._inbox or self._aborts or self.scheduler.has_work() or self._in_flight):
                self._wakeup.wait(timeout)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            free_blocks=self.engine.free_blocks,
            total_blocks=self.engine.total_blocks,
            requests_finished=self.requests_finished,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            preemptions=self.scheduler.num_preemptions,
        )

    # ---- the stepping thread -------------------------------------------------------------------

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts) or self.scheduler.has_work() or self._in_flight is not None

    def step(self) -> None:
        """One iteration: schedule and queue the next forward, then read back the previous one's
        tokens (overlapped), or this one's (not)."""
        self._take_inbox()
        scheduled = self.scheduler.schedule()
        launched = None
        if scheduled.step.uids or scheduled.step.flush_uids:
            launched = self._launch(scheduled)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self._read_back(previous)
        if not self.overlap and self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._read_back(launched)

    def _launch(self, scheduled: ScheduledStep) -> _SampledStep | None:
        """Queue the step's forward and the sampling of every sequence whose prompt it completes;
        returns the step whose ids are to be read back, or None when it samples nothing."""
        try:
            logits = self.executor.execute(scheduled.step)
            to_sample: list[tuple[int, Request]] = []
            for row, (req, new_tokens) in enumerate(zip(scheduled.requests, scheduled.step.tokens)):
                req.num_computed_tokens += len(new_tokens)
                if req.num_computed_tokens == req.num_tokens:
                    to_sample.append((row, req))
            if not to_sample:
                return None
            assert logits is not None
            if len(to_sample) < logits.shape[0]:  # some sequences are mid-prompt: sample the others
                logits = logits.index_select(0, to_device([row for row, _ in to_sample], torch.int64, logits.device))
            ids = sample_on_device(logits, [req.sampling_row() for _, req in to_sample])
        except Exception as err:  # a failed forward must not strand the requests in it
            log.exception("forward pass failed; failing the %d requests in it", len(scheduled.requests))
            for req in scheduled.requests:
                self._finish(req, RequestUpdate(req.uid, None, err))
            return None
        if self.overlap:
            self.engine.feed_back(ids)
        requests = [req for _, req in to_sample]
        for i, req in enumerate(requests):
            req.launched_sample(fed_back_placeholder(i))
        return _SampledStep(requests, _HostCopy(ids))

    def _read_back(self, sampled: _SampledStep) -> None:
        """Wait for a launched step's ids and hand each request its token."""
        for token, req in zip(sampled.ids.wait(), sampled.requests):
            if req.status is RequestStatus.FINISHED:  # aborted, or stopped by the token before this one
                continue
            response = req.append(token)
            self.generated_tokens += 1
            update = RequestUpdate(req.uid, response)
            if update.finished:
                self._finish(req, update)
            else:
                self._emit(req, update)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in inbox:
            self._live[req.uid] = req
            self.prompt_tokens += len(req.prompt_ids)
            self.scheduler.add(req)
        for uid in aborts:
            req = self._live.get(uid)
            if req is not None:
                self._finish(req, RequestUpdate(uid, req.abort_response()))

    def _finish(self, req: Request, update: RequestUpdate) -> None:
        self.scheduler.finish(req)
        self._live.pop(req.uid, None)
        self.requests_finished += 1
        self._emit(req, update)

    @staticmethod
    def _emit(req: Request, update: RequestUpdate) -> None:
        try:
            req.sink(update)
        except Exception:  # a broken consumer must not stop the batch
            log.exception("sink of request %d failed", req.uid)

    def fail_all(self, err: Exception) -> None:
        """Finish every live and queued request with ``err`` (the engine is going away)."""
        self._take_inbox()
        self._in_flight = None
        for req in list(self._live.values()):
            if req.status is not RequestStatus.FINISHED:
                self._finish(req, RequestUpdate(req.uid, None, err))
