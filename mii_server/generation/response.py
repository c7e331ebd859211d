"""What a finished (or streaming) request hands back to the caller."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class FinishReason(str, Enum):
    """Why generation ended; NONE marks an intermediate streaming chunk."""

    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_new_tokens or max_length reached
    ABORT = "abort"  # cancelled by the client or the server
    NONE = "none"  # still generating (streaming chunk)


@dataclass
class TopLogprob:
    """One candidate for a position: a token and its log-probability."""

    token_id: int
    token: str  # the token decoded alone (a partial UTF-8 character decodes to U+FFFD)
    logprob: float  # natural log of its probability under the model (raw: before sampling controls)


@dataclass
class TokenLogprob:
    """The log-probability of the token at one position, and the most likely tokens there.

    Raw log-probabilities: the model's log-softmax over the full vocabulary, before temperature,
    penalties, logit_bias, top-k/top-p/min_p and banned ids (vLLM's default, ``raw_logprobs``).
    """

    token_id: int  # the token at this position (sampled, or the prompt's)
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)  # the k most likely, most likely first


@dataclass
class Response:
    """One prompt's result; for a streaming chunk, the text and tokens new since the last chunk."""

    generated_text: str  # decoded output (the delta, for a streaming chunk)
    prompt_length: int  # tokens in the prompt
    generated_length: int  # tokens generated so far in total
    finish_reason: FinishReason  # stop / length once finished, none while streaming
    token_ids: list[int] = field(default_factory=list)  # generated ids (the delta, for a chunk)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not recomputed)
    # with logprobs=k: one entry per id of token_ids (the delta, for a chunk); else None
    logprobs: list[TokenLogprob] | None = None
    # with prompt_logprobs=k: one entry per prompt token, the first None (nothing precedes it);
    # in a stream only the first chunk with tokens carries it; else None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __str__(self) -> str:
        return self.generated_text

    def to_msg_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["finish_reason"] = self.finish_reason.value
        return d

    @classmethod
    def from_msg_dict(cls, d: dict[str, Any]) -> Response:
        d = {**d, "finish_reason": FinishReason(d["finish_reason"])}
        if d.get("logprobs") is not None:
            d["logprobs"] = [_token_logprob(e) for e in d["logprobs"]]
        if d.get("prompt_logprobs") is not None:
            d["prompt_logprobs"] = [None if e is None else _token_logprob(e) for e in d["prompt_logprobs"]]
        return cls(**d)

    @classmethod
    def join(cls, chunks: Sequence[Response]) -> Response:
        """One prompt's streamed deltas, in order, folded into its whole Response."""
        last = chunks[-1]
        with_logprobs = [c.logprobs for c in chunks if c.logprobs is not None]
        return cls(
            generated_text="".join(c.generated_text for c in chunks),
            prompt_length=last.prompt_length,
            generated_length=last.generated_length,
            finish_reason=last.finish_reason,
            token_ids=[t for c in chunks for t in c.token_ids],
            cached_tokens=last.cached_tokens,
            logprobs=[e for lp in with_logprobs for e in lp] if with_logprobs else None,
            prompt_logprobs=next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None),
        )


def _token_logprob(d: dict[str, Any]) -> TokenLogprob:
    return TokenLogprob(**{**d, "top_logprobs": [TopLogprob(**t) for t in d["top_logprobs"]]})
