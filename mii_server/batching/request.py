"""Request: one prompt's life on rank 0, from admission to its last token."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..generation.detokenizer import IncrementalDetokenizer
from ..generation.params import GenerateParams
from ..generation.response import FinishReason, Response
from ..generation.sampler import SamplingRow
from ..generation.stopping import StopStringMatcher


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

    def __post_init__(self) -> None:
        self.stop_strings = StopStringMatcher(self.params.stop)

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
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_in_flight

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the KV cache (the whole sequence after a preemption); 0 once the last
        token to generate is in flight, since nothing more will be fed."""
        if self.num_generated >= self.max_new_tokens:
            return 0
        return self.num_tokens - self.num_computed_tokens

    def sampling_row(self) -> SamplingRow:
        p = self.params
        banned = sorted(self.stop_ids) if self.num_generated < p.min_new_tokens else ()
        return SamplingRow(
            greedy=not p.do_sample,
            temperature=p.temperature or 1.0,
            top_k=p.top_k,
            top_p=p.top_p,
            generator=self.generator,
            banned_ids=banned,
        )

    def launched_sample(self, placeholder: int) -> None:
        """A token was sampled on the device; until ``append`` reads it back, steps feed it as
        ``placeholder``."""
        self.num_in_flight += 1
        self.fed_back_token = placeholder

    def append(self, token_id: int) -> Response:
        """Record a sampled token; return the update's response (finish_reason NONE unless done)."""
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
        return self._response(text, [token_id], finish)

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
        )
