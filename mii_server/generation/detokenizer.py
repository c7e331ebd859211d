"""Incremental detokenisation that never splits a UTF-8 character.

Byte-level tokenizers emit multi-byte characters across several tokens; decoding a partial
character yields U+FFFD. We decode a short window of recent ids and release text only once it no
longer ends in a replacement character, so the chunks joined equal the whole decode.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context: enough for tokenizers that decide a leading space from the
# previous token (SentencePiece) and for byte sequences begun in the prompt.
_CONTEXT_TOKENS = 6


def _fast_decode(tokenizer: Any) -> Any:
    """The Rust tokenizer's own ``decode`` when it is exactly what ``tokenizer.decode`` would run
    (a plain fast tokenizer, no cleanup); None otherwise.

    why: transformers' Python wrapper costs several times the decode itself, and the serving loop
    decodes twice per generated token of every running request.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or type(tokenizer)._decode is not PreTrainedTokenizerFast._decode:
        return None
    return tokenizer.backend_tokenizer.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self._backend_decode = _fast_decode(tokenizer)
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(self.ids)  # ids before this are already released as text

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (may be empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def push_all(self, token_ids: list[int]) -> str:
        """Add many generated ids at once; return the text they complete (as ``push`` one by one
        would, joined)."""
        if not token_ids:
            return ""
        self.ids.extend(token_ids[:-1])
        return self.push(token_ids[-1])

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (an unfinished character decodes
        to U+FFFD, as a whole decode of the ids would show it)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
