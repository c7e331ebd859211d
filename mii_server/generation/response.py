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
class Response:
    """One prompt's result; for a streaming chunk, the text and tokens new since the last chunk."""

    generated_text: str  # decoded output (the delta, for a streaming chunk)
    prompt_length: int  # tokens in the prompt
    generated_length: int  # tokens generated so far in total
    finish_reason: FinishReason  # stop / length once finished, none while streaming
    token_ids: list[int] = field(default_factory=list)  # generated ids (the delta, for a chunk)

    def __str__(self) -> str:
        return self.generated_text

    def to_msg_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["finish_reason"] = self.finish_reason.value
        return d

    @classmethod
    def from_msg_dict(cls, d: dict[str, Any]) -> Response:
        return cls(**{**d, "finish_reason": FinishReason(d["finish_reason"])})

    @classmethod
    def join(cls, chunks: Sequence[Response]) -> Response:
        """One prompt's streamed deltas, in order, folded into its whole Response."""
        last = chunks[-1]
        return cls(
            generated_text="".join(c.generated_text for c in chunks),
            prompt_length=last.prompt_length,
            generated_length=last.generated_length,
            finish_reason=last.finish_reason,
            token_ids=[t for c in chunks for t in c.token_ids],
        )
