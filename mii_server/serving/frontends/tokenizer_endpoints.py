"""vLLM's tokenizer endpoints, as clients probe them (lm-evaluation-harness's ``local-completions`` uses
``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` when they answer): request bodies and reply
bodies, plain Python. The tokenizer itself runs on a replica (``Tokenize``, ``TokenizerInfo`` RPCs).

- ``POST /tokenize`` ``{"prompt": text | token ids, "add_special_tokens": true, "return_token_strs": false}``
  or ``{"messages": [...], "add_generation_prompt": true}`` (rendered with the chat template first,
  then tokenised without special tokens, as vLLM does) -> ``{"count", "max_model_len", "tokens",
  "token_strs"}``.
- ``POST /detokenize`` ``{"tokens": [ids]}`` -> ``{"prompt": text}``.
- ``GET /tokenizer_info`` -> the special tokens, the chat template, ``model_max_length`` and ``vocab_size``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, model_validator

from ...wire.types import Tokenized, TokenizerInfo
from .openai_protocol import ChatMessage, TokenId, bad_request, chat_messages, validation_error


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr | None = None
    prompt: StrictStr | list[TokenId] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' (text or token ids) or 'messages'")
        return self

    @property
    def message_pairs(self) -> list[tuple[str, str]] | None:
        return None if self.messages is None else chat_messages(self.messages)

    @property
    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None  # a rendered template already holds its special tokens


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr | None = None
    tokens: list[TokenId] = Field(min_length=1)


def parse_tokenize(body: Any) -> TokenizeRequest:
    return _parse(TokenizeRequest, body)


def parse_detokenize(body: Any) -> DetokenizeRequest:
    return _parse(DetokenizeRequest, body)


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_error(err) from None


def tokenize_body(result: Tokenized, max_model_len: int, token_strings: bool) -> dict[str, Any]:
    return {
        "count": len(result.token_ids),
        "max_model_len": max_model_len,
        "tokens": result.token_ids,
        "token_strs": result.token_strings if token_strings else None,
    }


def detokenize_body(result: Tokenized) -> dict[str, Any]:
    return {"prompt": result.text}


def tokenizer_info_body(info: TokenizerInfo) -> dict[str, Any]:
    return {
        "tokenizer_class": info.tokenizer_class,
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "pad_token": info.pad_token,
        "unk_token": info.unk_token,
        "chat_template": info.chat_template or None,
        "model_max_length": info.max_model_len,
        "vocab_size": info.vocab_size,
    }
