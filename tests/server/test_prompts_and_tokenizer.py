"""Unit: the one check of a caller's prompts (text, token ids), and the replica's tokenizer service over a
real Hugging Face tokenizer (a tiny test checkpoint's)."""

from __future__ import annotations

import pytest

from mii_server.errors import InvalidRequest
from mii_server.replica import tokenizer_service
from mii_server.wire.prompts import prompt_list


def test_prompt_shapes() -> None:
    assert prompt_list("a") == ["a"]
    assert prompt_list(["a", "b"]) == ["a", "b"]
    assert prompt_list([1, 2, 3]) == [[1, 2, 3]]  # one prompt of ids, as OpenAI reads it
    assert prompt_list([[1, 2], [3]]) == [[1, 2], [3]]
    assert prompt_list(["a", (4, 5)]) == ["a", [4, 5]]
    assert prompt_list([]) == []


@pytest.mark.parametrize(
    ("prompts", "fragment"),
    [
        (123, "got int"),
        (None, "got NoneType"),
        ({"a": 1}, "got dict"),
        ([1.5], "prompts[0] must be a string or a list of token ids"),
        ([True, False], "prompts[0]"),  # bools are not token ids
        ([[1, True]], "prompts[0]"),
        ([[]], "prompts[0] is an empty list"),
        ([-1], "token id -1"),
        ([[2**63]], "token id 9223372036854775808"),
        (["a", None], "prompts[1]"),
    ],
)
def test_bad_prompts_say_what_is_wrong(prompts: object, fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        prompt_list(prompts)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoints["llama"]))


def test_tokenize_text_and_ids(tokenizer) -> None:
    vocab = len(tokenizer)
    text = "The quick brown fox"
    (by_text, by_ids) = tokenizer_service.tokenize(
        tokenizer, [text, [5, 6, 7]], vocab, add_special_tokens=True, token_strings=True
    )
    assert by_text.token_ids == tokenizer.encode(text) and by_text.text == text
    assert by_text.token_strings == [tokenizer.decode([t]) for t in by_text.token_ids]
    assert by_ids.text == tokenizer.decode([5, 6, 7]) and by_ids.token_ids == [5, 6, 7]
    (bare,) = tokenizer_service.tokenize(tokenizer, [text], vocab, add_special_tokens=False, token_strings=False)
    assert bare.token_ids == tokenizer.encode(text, add_special_tokens=False) and bare.token_strings == []
    with pytest.raises(InvalidRequest, match=f"prompt 1 has token id {vocab}, outside the vocabulary"):
        tokenizer_service.tokenize(tokenizer, [text, [1, vocab]], vocab, add_special_tokens=True, token_strings=False)
    assert tokenizer_service.vocabulary_size(tokenizer, 10) == 10  # the model's embedding can be smaller
    assert tokenizer_service.vocabulary_size(tokenizer, 10**6) == vocab


def test_describe(tokenizer) -> None:
    info = tokenizer_service.describe(tokenizer, 1024, len(tokenizer))
    assert (info.eos_token, info.bos_token, info.max_model_len) == (tokenizer.eos_token, tokenizer.bos_token, 1024)
    assert info.chat_template == (tokenizer.chat_template or "")
    assert info.tokenizer_class == type(tokenizer).__name__
