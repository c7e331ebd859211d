"""The replica's tokenizer as a service: token-id prompts checked, text encoded and ids decoded, the
tokenizer described (the ``Tokenize`` and ``TokenizerInfo`` RPCs, and the check every token-id prompt
of ``Generate`` passes). Plain functions over a Hugging Face tokenizer; they run on the servicer's
prepare pool, off the event loop and off the batching loop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InvalidRequest
from ..wire.types import Prompt, Tokenized, TokenizerInfo


def vocabulary_size(tokenizer: Any, model_vocab_size: int) -> int:
    """Token ids a prompt may use: those both the tokenizer and the model's embedding know."""
    return min(len(tokenizer), model_vocab_size)


def check_token_ids(prompts: Sequence[Prompt], vocab_size: int) -> None:
    """``InvalidRequest`` naming the first token-id prompt with an id outside ``0 .. vocab_size - 1``."""
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            continue
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"prompt {i} has token id {bad}, outside the vocabulary (token ids are 0 to {vocab_size - 1})"
            )


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token decoded alone, as log-probabilities name tokens (a partial UTF-8 character is U+FFFD)."""
    return tokenizer.decode([token_id])


def tokenize(
    tokenizer: Any, prompts: Sequence[Prompt], vocab_size: int, *, add_special_tokens: bool, token_strings: bool
) -> list[Tokenized]:
    """Text encoded (with the tokenizer's special tokens when ``add_special_tokens``, as generation
    encodes prompts), token ids checked and decoded (as generation decodes them for ``echo``)."""
    check_token_ids(prompts, vocab_size)
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids, text = tokenizer.encode(prompt, add_special_tokens=add_special_tokens), prompt
        else:
            ids, text = list(prompt), tokenizer.decode(list(prompt))
        strings = [token_text(tokenizer, t) for t in ids] if token_strings else []
        out.append(Tokenized(token_ids=ids, text=text, token_strings=strings))
    return out


def describe(tokenizer: Any, context_length: int, vocab_size: int) -> TokenizerInfo:
    """The tokenizer's special tokens and chat template, the vocabulary size and the context length."""

    def special(name: str) -> str | None:
        value = getattr(tokenizer, name, None)
        return value if isinstance(value, str) else None

    template = getattr(tokenizer, "chat_template", None)
    return TokenizerInfo(
        tokenizer_class=type(tokenizer).__name__,
        bos_token=special("bos_token"),
        eos_token=special("eos_token"),
        pad_token=special("pad_token"),
        unk_token=special("unk_token"),
        chat_template=template if isinstance(template, str) else "",  # a dict of named ones: not shown
        max_model_len=context_length,
        vocab_size=vocab_size,
    )
