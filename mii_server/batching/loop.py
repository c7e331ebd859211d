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
from ..generation.logprobs import logprobs_of, token_logprobs
from ..generation.params import GenerateParams
from ..generation.penalties import PenaltyCounts
from ..generation.response import TokenLogprob
from ..generation.sampler import sample_on_device, to_device
from ..wire.types import EngineStats
from .executor import StepExecutor
from .host_copy import HostCopy
from .request import Request, RequestStatus, RequestUpdate, Sink
from .scheduler import ScheduledStep, Scheduler
from .step import fed_back_placeholder

log = logging.getLogger(__name__)

# A token covers at most this many characters in any tokenizer we serve (long whitespace runs included):
# longer prompts cannot fit the context and are refused before tokenisation.
MAX_CHARS_PER_TOKEN = 64


@dataclass
class _SampledStep:
    """A launched step that sampled ``requests`` (in row order); their ids arrive through
    ``values``: (ids,), or (ids, chosen log-probs, top ids, top log-probs) when some row asked for
    log-probabilities (those rows' requests, in order)."""

    requests: list[Request]
    values: HostCopy


class GenerationLoop:
    """Runs the batching loop over one engine.

    ``overlap``: queue step N+1 before reading back step N's sampled ids, so the host's scheduling
    and bookkeeping run while the device computes. Step N+1 feeds N's tokens from the device
    (placeholders in its token lists, see ``Step.tokens``); under tensor parallelism the followers
    receive those ids from rank 0 on the device (``tensor_parallel.executor.share_fed_back``). A
    request that stops on a token of step N has one more token computed in N+1, which is discarded.
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
        vocab_size: int | None = None,
    ) -> None:
        """``vocab_size``: the model's logits width (default: the tokenizer's length)."""
        self.executor = executor
        self.overlap = overlap
        self._in_flight: _SampledStep | None = None  # launched, ids not read back yet (overlap only)
        self.engine = executor.engine
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.default_max_length = default_max_length
        self.scheduler = Scheduler(
            self.engine, max_batch_tokens, max_batch_sequences, max_tracked_sequences,
            prefix_caching=self.engine.prefix_cache is not None,
        )  # fmt: skip
        self.vocab_size = len(tokenizer) if vocab_size is None else vocab_size
        self.penalties = PenaltyCounts(self.vocab_size, self.engine.device)
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (log-probabilities)
        self._uids = itertools.count()
        self._seed = seed
        self._lock = threading.Lock()  # guards the inbox and the abort list
        self._tokenizer_lock = threading.Lock()  # encodes (a fast tokenizer's settings are not thread-safe)
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
        return self.prepare_many([prompt], params, [sink], stream)[0]

    def prepare_many(
        self, prompts: list[str | list[int]], params: GenerateParams, sinks: list[Sink], stream: bool = True
    ) -> list[Request]:
        """``prepare`` for several prompts, each with its sink; raises InvalidRequest for the first bad
        one. Their texts are tokenised in one batch: a fast tokenizer encodes a batch on every core,
        where one prompt at a time would take one (1.6-2.0x on 2 cores, bench/tokenize_batch_bench.py)."""
        for prompt in prompts:
            if isinstance(prompt, str) and len(prompt) > self.context_length * MAX_CHARS_PER_TOKEN:
                # why before tokenising: a 10 MB prompt takes seconds to tokenise and can never fit
                raise InvalidRequest(
                    f"the prompt has {len(prompt)} characters; no prompt of more than "
                    f"{self.context_length * MAX_CHARS_PER_TOKEN} fits this model's {self.context_length}-token context"
                )
        with self._tokenizer_lock:  # not the loop's lock: the batching thread never waits on a tokenisation
            encoded = iter(self._encode([p for p in prompts if isinstance(p, str)]))
            tokenized = [
                (next(encoded), p) if isinstance(p, str) else (list(p), self.tokenizer.decode(list(p)))
                for p in prompts
            ]
        return [self._request(ids, text, params, sink, stream) for (ids, text), sink in zip(tokenized, sinks)]

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if len(texts) > 1 and getattr(self.tokenizer, "is_fast", False):
            return self.tokenizer(texts)["input_ids"]  # what encode gives each, in one parallel call
        return [self.tokenizer.encode(text) for text in texts]

    def _request(self, ids: list[int], text: str, params: GenerateParams, sink: Sink, stream: bool) -> Request:
        """A validated request of prompt ``ids`` (``text``); raises InvalidRequest."""
        uid = next(self._uids)  # itertools.count: atomic under the GIL
        if not ids:
            raise InvalidRequest("the prompt is empty (no tokens)")
        max_new = params.limits_for(len(ids), self.default_max_length, self.context_length)
        need = blocks_for(len(ids) + max_new, self.engine.block_size)
        if need > self.engine.total_blocks:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) plus up to {max_new} new tokens needs {need} KV blocks, but the "
                f"cache holds {self.engine.total_blocks}; lower max_new_tokens or give the cache more memory"
            )
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequest(
                f"logit_bias names token {max(params.logit_bias)}; the vocabulary has {self.vocab_size}"
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
            cached_prompt_tokens=self.scheduler.cached_prompt_tokens,
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
        step = scheduled.step
        try:
            logits = self.executor.execute(step)
            to_sample: list[tuple[int, Request]] = []  # (logits row, request)
            if step.full_logits:
                self._queue_prompt_logprobs(logits, self._full_logit_rows(scheduled))
            row = 0  # the logits row of each entry's last token
            full = set(step.full_logits)
            for i, (req, new_tokens) in enumerate(zip(scheduled.requests, step.tokens)):
                if full and i in full:
                    row += len(new_tokens) - 1
                req.num_computed_tokens += len(new_tokens)
                if req.num_computed_tokens == req.num_tokens:
                    to_sample.append((row, req))
                row += 1
            if not to_sample:
                return None
            assert logits is not None
            if len(to_sample) < logits.shape[0]:  # some sequences are mid-prompt: sample the others
                logits = logits.index_select(0, to_device([row for row, _ in to_sample], torch.int64, logits.device))
            rows = [req.sampling_row(self.penalties) for _, req in to_sample]
            sampled = sample_on_device(logits, rows, self.penalties)
        except Exception as err:  # a failed forward must not strand the requests in it
            log.exception("forward pass failed; failing the %d requests in it", len(scheduled.requests))
            for req in scheduled.requests:
                self._finish(req, RequestUpdate(req.uid, None, err))
            return None
        if self.overlap:
            self.engine.feed_back(sampled.ids)
        requests = [req for _, req in to_sample]
        for i, req in enumerate(requests):
            req.launched_sample(fed_back_placeholder(i))
        extra = sampled.logprobs.tensors() if sampled.logprobs is not None else ()
        return _SampledStep(requests, HostCopy(sampled.ids, *extra))

    @staticmethod
    def _full_logit_rows(scheduled: ScheduledStep) -> list[tuple[Request, int, int, int]]:
        """(request, first logits row, position of that row, rows) of each full-logits entry,
        before the step's tokens count as computed."""
        out = []
        full = set(scheduled.step.full_logits)
        row = 0
        for i, (req, new_tokens) in enumerate(zip(scheduled.requests, scheduled.step.tokens)):
            if i in full:
                out.append((req, row, req.num_computed_tokens, len(new_tokens)))
            row += len(new_tokens) if i in full else 1
        return out

    def _queue_prompt_logprobs(
        self, logits: torch.Tensor, parts: list[tuple[Request, int, int, int]]
    ) -> None:
        """Queue the log-probabilities of the prompt tokens that ``parts`` (request, first logits
        row, position of that row, rows) predict and that are not computed yet; each request keeps
        its share of the copy until its first token is read back."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[Request, int, int]] = []  # (request, first row in the result, rows)
        for req, first_row, position, n in parts:
            lo = max(position, req.num_prompt_logprobs)  # position p predicts prompt token p + 1
            hi = min(position + n, len(req.prompt_ids) - 1)
            if hi <= lo:
                continue
            spans.append((req, len(rows), hi - lo))
            rows.extend(range(first_row + lo - position, first_row + hi - position))
            targets.extend(req.prompt_ids[lo + 1 : hi + 1])
            req.prompt_logprobs_queued(hi)
        if not spans:
            return
        k = max(req.params.prompt_logprobs or 0 for req, _, _ in spans)
        device = logits.device
        rows_logits = logits.index_select(0, to_device(rows, torch.int64, device))  # [M, V]
        copy = HostCopy(*logprobs_of(rows_logits, to_device(targets, torch.int64, device), k).tensors())
        for req, first, count in spans:
            req.prompt_logprob_parts.append((copy, first, count))

    def _read_back(self, sampled: _SampledStep) -> None:
        """Wait for a launched step's ids (and log-probabilities) and hand each request its token."""
        values = sampled.values.wait()
        next_logprob = 0  # index into the log-probability rows (the requests that asked, in order)
        for token, req in zip(values[0], sampled.requests):
            m = -1
            if req.wants_logprobs:
                m, next_logprob = next_logprob, next_logprob + 1
            if req.status is RequestStatus.FINISHED:  # aborted, or stopped by the token before this one
                continue
            logprob = None
            if m >= 0:
                chosen, top_ids, top_logprobs = values[1][m], values[2][m], values[3][m]
                k = req.params.logprobs or 0
                (logprob,) = token_logprobs([token], [chosen], [top_ids], [top_logprobs], [k], self._token_text)
            prompt_logprobs = None
            if not req.output_ids and req.params.prompt_logprobs is not None:  # its first token
                prompt_logprobs = self._prompt_logprobs(req)
            response = req.append(token, logprob, prompt_logprobs)
            self.generated_tokens += 1
            update = RequestUpdate(req.uid, response)
            if update.finished:
                self._finish(req, update)
            else:
                self._emit(req, update)

    def _prompt_logprobs(self, req: Request) -> list[TokenLogprob | None]:
        """The prompt's log-probabilities, from the parts its prompt chunks queued."""
        out: list[TokenLogprob | None] = [None]  # nothing predicts the first token
        k = req.params.prompt_logprobs or 0
        for copy, first, count in req.prompt_logprob_parts:
            chosen, top_ids, top_logprobs = copy.wait()
            span = slice(first, first + count)
            targets = req.prompt_ids[len(out) : len(out) + count]
            out += token_logprobs(
                targets, chosen[span], top_ids[span], top_logprobs[span], [k] * count, self._token_text
            )
        req.prompt_logprob_parts.clear()
        return out

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

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
        self.penalties.release(req.uid)
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
