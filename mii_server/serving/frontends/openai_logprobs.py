"""Log-probabilities in OpenAI's two shapes (plain Python, no framework).

``/v1/completions`` (the legacy shape lm-evaluation-harness reads): parallel lists ``tokens``,
``token_logprobs``, ``top_logprobs`` (a dict token -> logprob holding the chosen token and the ``k``
most likely, so up to ``k + 1`` entries, as OpenAI and vLLM do) and ``text_offset`` (each token's
character offset in the returned text). With ``echo`` the prompt's tokens come first; the first
prompt token has no log-probability (nothing precedes it): ``null`` in both ``token_logprobs`` and
``top_logprobs``.

``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``
with exactly ``top_logprobs`` alternatives per token.

Values are the engine's raw log-probabilities (the model's log-softmax before sampling controls).
JSON has no infinity: a value below ``LOGPROB_FLOOR`` is sent as the floor (vLLM's rule). A token's
text is the token decoded alone, so a token that holds part of a UTF-8 character reads U+FFFD, and
its ``bytes`` are that text's UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...generation.response import TokenLogprob

LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    """``logprob`` clamped to ``LOGPROB_FLOOR`` (also what a NaN becomes)."""
    return max(LOGPROB_FLOOR, logprob)


@dataclass
class Position:
    """One token of a choice's log-probabilities: its text, and its entry (None: the first prompt token)."""

    token: str
    entry: TokenLogprob | None


def prompt_positions(first_token: str, prompt_logprobs: Sequence[TokenLogprob | None]) -> list[Position]:
    """The prompt's positions (echo): the first token by its text alone, the rest with their entries."""
    out = [Position(first_token, None)]
    out += [Position("" if e is None else e.token, e) for e in prompt_logprobs[1:]]
    return out


def generated_positions(entries: Sequence[TokenLogprob]) -> list[Position]:
    return [Position(e.token, e) for e in entries]


def completion_logprobs(positions: Sequence[Position], offset: int) -> tuple[dict[str, Any], int]:
    """The completions ``logprobs`` object of ``positions`` whose first token starts at character
    ``offset`` of the returned text, and the offset after the last one."""
    tokens, values, tops, offsets = [], [], [], []
    for p in positions:
        tokens.append(p.token)
        offsets.append(offset)
        offset += len(p.token)
        if p.entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(finite(p.entry.logprob))
        top = {p.entry.token: finite(p.entry.logprob)}  # the chosen token is always listed
        for t in p.entry.top_logprobs:
            top.setdefault(t.token, finite(t.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def _token_body(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(positions: Sequence[Position]) -> dict[str, Any]:
    """The chat ``logprobs`` object (generated tokens only: every position has its entry)."""
    content = []
    for p in positions:
        assert p.entry is not None, "chat log-probabilities are of generated tokens"
        body = _token_body(p.entry.token, p.entry.logprob)
        body["top_logprobs"] = [_token_body(t.token, t.logprob) for t in p.entry.top_logprobs]
        content.append(body)
    return {"content": content, "refusal": None}
