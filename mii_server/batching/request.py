"""Request: one prompt's life on rank 0, from admission to its last token."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..generation.detokenizer import IncrementalDetokenizer
from ..generation.params import GenerateParams
from ..generation.penalties import PenaltyCounts
from ..generation.response import FinishReason, Response, TokenLogprob
from ..generation.sampler import SamplingRow
from ..generation.stopping import StopStringMatcher
from .host_copy import HostCopy


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not in the KV cache (new, or preempted and to be recomputed)
    RUNNING = "running"  # admitted: its computed tokens are in the KV cache
    FINISHED = "finished"


@dataclass
class RequestUpdate:
    """What one step produced for one request. The last update has a final finish reason or an error."""

    uid: int
    response: Response | None  # delta: text and ids new since the last update
    error: Exception | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or (
            self.response is not None and self.response.finish_reason is not FinishReason.NONE
        )


Sink = Callable[[RequestUpdate], None]


@dataclass
class Request:
    uid: int
    prompt_ids: list[int]
    params: GenerateParams
    max_new_tokens: int  # resolved from max_new_tokens / max_length / the context
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None  # None for greedy requests
    sink: Sink
    prompt_text: str = ""  # for return_full_text
    incremental_text: bool = True  # decode token by token (streaming, stop strings), else once at the end
    output_ids: list[int] = field(default_factory=list)  # generated tokens the host has read back
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # A token sampled on the device whose id the host has not read back yet (overlapped steps):
    # it follows output_ids, and a step may feed it to the model as ``fed_back_token``.
    num_in_flight: int = 0
    fed_back_token: int = 0  # Step placeholder (negative) for the in-flight token; see Step.tokens
    status: RequestStatus = RequestStatus.WAITING
    stop_strings: StopStringMatcher = field(init=False)
    first_update_sent: bool = False
    # prefix caching (kept by the scheduler)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its first full blocks
    num_registered_blocks: int = 0  # leading blocks whose content the engine's cache knows
    num_cached_tokens: int | None = None  # prompt tokens taken from the cache at first admission
    # prompt log-probabilities: logits positions 0 .. n-1 are computed (n is this), and where the
    # values wait to be read back: (copy of a Logprobs' tensors, first row, rows)
    num_prompt_logprobs: int = 0
    prompt_logprob_parts: list[tuple[HostCopy, int, int]] = field(default_factory=list)
    # prompt log-probabilities asked for and not all computed (a flag: the scheduler reads it per step)
    full_logits_pending: bool = field(init=False)
    wants_logprobs: bool = field(init=False)  # logprobs asked for
    penalized: bool = field(init=False)  # presence, frequency or repetition penalty asked for
    # the rows sampling_row hands out, built once each: before min_new_tokens (stop ids banned), after
    _rows: dict[bool, SamplingRow] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.stop_strings = StopStringMatcher(self.params.stop)
        p = self.params
        self.full_logits_pending = p.prompt_logprobs is not None and len(self.prompt_ids) > 1
        self.wants_logprobs = p.logprobs is not None
        self.penalized = p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens ``start:start+n`` of prompt + output (+ the in-flight token's placeholder), without
        copying the whole sequence."""
        p = len(self.prompt_ids)
        if start >= p:
            out = self.output_ids[start - p : start - p + n]
        else:
            out = (self.prompt_ids[start : start + n] + self.output_ids)[:n]
        if len(out) < n and self.num_in_flight:
            assert self.num_in_flight == 1, "a step is scheduled with at most one token in flight"
            out.append(self.fed_back_token)
        return out

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, counting one still in flight."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_in_flight

    @property
    def num_known_tokens(self) -> int:
        """Prompt and generated tokens whose ids the host has (not a token in flight)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def wants_full_logits(self, n: int) -> bool:
        """Whether feeding the next ``n`` tokens must return logits for each of them: prompt
        log-probabilities are asked for and that chunk reaches positions not computed yet."""
        return self.full_logits_pending and self.num_computed_tokens + n > self.num_prompt_logprobs

    def prompt_logprobs_queued(self, upto: int) -> None:
        """Logits positions below ``upto`` have their prompt log-probabilities computed."""
        self.num_prompt_logprobs = upto
        self.full_logits_pending = upto < len(self.prompt_ids) - 1

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_in_flight

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the KV cache (the whole sequence after a preemption); 0 once the last
        token to generate is in flight, since nothing more will be fed."""
        if self.num_generated >= self.max_new_tokens:
            return 0
        return self.num_tokens - self.num_computed_tokens

    def sampling_row(self, penalties: PenaltyCounts | None = None) -> SamplingRow:
        """How to sample this request's next token; a penalized request needs ``penalties``.

        A request has at most two rows, each built once: one banning its stop ids until
        min_new_tokens is reached (none when it has no stop ids), then one without (its PenaltyCounts
        row is the request's for its whole life): building a row per token would cost the hot loop."""
        p = self.params
        banning = bool(self.stop_ids) and self.num_generated < p.min_new_tokens
        row = self._rows.get(banning)
        if row is not None:
            return row
        penalty_row = None
        if self.penalized:
            assert penalties is not None, "a penalized request samples with the loop's PenaltyCounts"
            penalty_row = penalties.row(self.uid, self.prompt_ids, self.output_ids)
        row = SamplingRow(
            greedy=not p.do_sample,
            temperature=p.temperature or 1.0,
            top_k=p.top_k,
            top_p=p.top_p,
            generator=self.generator,
            banned_ids=sorted(self.stop_ids) if banning else (),
            min_p=p.min_p,
            bias_ids=tuple(p.logit_bias),
            bias_values=tuple(p.logit_bias.values()),
            penalty_row=penalty_row,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logprobs=p.logprobs,
        )
        self._rows[banning] = row
        return row

    def launched_sample(self, placeholder: int) -> None:
        """A token was sampled on the device; until ``append`` reads it back, steps feed it as
        ``placeholder``."""
        self.num_in_flight += 1
        self.fed_back_token = placeholder

    def append(
        self,
        token_id: int,
        logprob: TokenLogprob | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> Response:
        """Record a sampled token (with its log-probabilities, when asked for); return the update's
        response (finish_reason NONE unless done)."""
        if self.num_in_flight:
            self.num_in_flight -= 1
        self.output_ids.append(token_id)
        finish = FinishReason.NONE
        text = ""
        if token_id in self.stop_ids:
            finish = FinishReason.STOP
        elif self.incremental_text:
            text = self.stop_strings.feed(self.detokenizer.push(token_id))
            if self.stop_strings.matched:
                finish = FinishReason.STOP
        if finish is FinishReason.NONE and len(self.output_ids) >= self.max_new_tokens:
            finish = FinishReason.LENGTH
        if finish is not FinishReason.NONE:
            if not self.incremental_text:  # the whole text at once (the stop token has no text)
                ids = self.output_ids[:-1] if finish is FinishReason.STOP else self.output_ids
                text = self.detokenizer.push_all(ids)
            text += self.stop_strings.feed(self.detokenizer.flush()) + self.stop_strings.flush()
        response = self._response(text, [token_id], finish)
        if logprob is not None:
            response.logprobs = [logprob]
        response.prompt_logprobs = prompt_logprobs
        return response

    def abort_response(self) -> Response:
        return self._response(self.stop_strings.flush(), [], FinishReason.ABORT)

    def _response(self, text: str, ids: list[int], finish: FinishReason) -> Response:
        if self.params.return_full_text and not self.first_update_sent:
            text = self.prompt_text + text
        self.first_update_sent = True
        return Response(
            generated_text=text,
            prompt_length=len(self.prompt_ids),
            generated_length=len(self.output_ids),
            finish_reason=finish,
            token_ids=ids,
            cached_tokens=self.num_cached_tokens or 0,
            logprobs=None if self.params.logprobs is None else [],
        )
