"""Incremental detokenisation never splits a UTF-8 character (tiny byte-level BPE tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mii_server.generation.detokenizer import IncrementalDetokenizer

TEXTS = [
    "café naïve façade Grüße",
    "東京 日本語 中文 한국어",
    "emoji 🙂🚀 and a family 👩‍👩‍👧",
    "Ελληνικά русский Ωmega 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",  # the last word is 4-byte characters outside the corpus
    "mixed: a東🙂é😀b",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints: dict[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoints["llama"]))


def pieces(tokenizer: Any, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.push(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_without_replacement_characters(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    out = pieces(tokenizer, [], ids)
    assert "".join(out) == text
    assert not any("\ufffd" in p for p in out)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_after_a_prompt(tokenizer: Any, text: str) -> None:
    prompt = tokenizer.encode("The quick brown fox 東")
    out = pieces(tokenizer, prompt, tokenizer.encode(" " + text))
    assert "".join(out) == " " + text
    assert not any("\ufffd" in p for p in out)


def test_multi_byte_characters_really_span_tokens(tokenizer: Any) -> None:
    # The test above is only meaningful if characters are split across tokens: they are, and the
    # detokeniser held their first bytes back (an empty piece) until the character was complete.
    ids = tokenizer.encode("𝔘𝔫𝔦")
    assert len(ids) > 3
    assert "\ufffd" in tokenizer.decode(ids[:1])
    out = pieces(tokenizer, [], ids)
    assert "" in out
    assert "".join(out) == "𝔘𝔫𝔦"
