"""Generation parameters: MII's generate kwargs, validated once, at the edge.

``GenerateParams.from_kwargs(**kwargs)`` is the one door: unknown names raise
``UnknownArgument``, bad values raise ``InvalidRequest``; both leave every other request alone.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ContextLengthExceeded, InvalidRequest, UnknownArgument

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's top_logprobs limit)
INT64_MAX = 2**63 - 1  # integers cross the wire as int64: a larger one is a bad value, not a crash


class GenerateParams(BaseModel):
    """What one request asks of generation. Field names are MII's, plus ``seed`` and ``stop_token_ids``."""

    # strict: "yes" is not a bool and "5" not an int (a wrong type is a 400, not a guess); ints
    # still pass for floats
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_new_tokens: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="Most tokens to generate; None means up to max_length."
    )
    max_length: int | None = Field(
        default=None,
        ge=1,
        le=INT64_MAX,
        description="Most tokens of prompt plus output; None means the deployment's max_length.",
    )
    min_new_tokens: int = Field(
        default=0, ge=0, le=INT64_MAX, description="EOS and stop_token_ids are suppressed until this many tokens exist."
    )
    do_sample: bool = Field(default=True, description="Sample from the distribution; False is greedy argmax.")
    temperature: float | None = Field(
        default=None, gt=0, le=100, description="Divides the logits before sampling; None means 1.0."
    )
    top_k: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="Sample only among the k most likely tokens."
    )
    top_p: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Nucleus sampling mass; applies only when do_sample is true (unlike MII).",
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end generation when they appear in the output (any token length); "
        "the stop string itself is not returned.",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Token ids that end generation, besides EOS."
    )
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS; only lengths stop.")
    return_full_text: bool = Field(default=False, description="Prefix the returned text with the prompt.")
    truncate_max_new_tokens: bool = Field(
        default=True,
        description="When max_new_tokens does not fit under max_length after the prompt: True generates "
        "fewer tokens (MII's behaviour), False refuses the request (the OpenAI API's).",
    )
    seed: int | None = Field(
        default=None, ge=0, lt=2**63, description="Seeds this request's sampler: the same seed repeats."
    )
    presence_penalty: float = Field(
        default=0.0,
        ge=-2,
        le=2,
        description="OpenAI's: subtracted from the logit of every token that occurs in the output so far "
        "(the prompt does not count, as in vLLM).",
    )
    frequency_penalty: float = Field(
        default=0.0,
        ge=-2,
        le=2,
        description="OpenAI's: subtracted, times the token's count, from the logit of every token in the "
        "output so far.",
    )
    repetition_penalty: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="Transformers' (CTRL's): the logit of every token of the prompt or the output so far is "
        "divided by it when positive, multiplied when negative; 1.0 is off. Applies to greedy requests too.",
    )
    min_p: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Sampling keeps only tokens at least min_p times as likely as the most likely one "
        "(after temperature); 0 is off.",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        description="Token id -> value added to its logit before sampling (-100 bans, 100 forces, in "
        "practice); OpenAI's. JSON object keys (decimal strings) are read as ids.",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each generated token's log-probability and the k most likely alternatives "
        "(raw: the model's log-softmax before any sampling control, as vLLM's default); None is off.",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each prompt token's log-probability given the tokens before it (the first "
        "has none) and the k most likely alternatives there; such a prompt is always computed, never "
        "taken from the prefix cache. None is off.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, tuple):
            return list(value)
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_non_negative(cls, value: list[int]) -> list[int]:
        if any(not 0 <= i <= INT64_MAX for i in value):
            raise ValueError("stop_token_ids must be token ids: integers from 0 to 2**63 - 1")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _json_keys_as_ids(cls, value: Any) -> Any:
        # why: a JSON object's keys are strings, so {"50256": -100} is how every HTTP caller writes it
        if isinstance(value, dict):
            return {int(k) if isinstance(k, str) and k.isdecimal() else k: v for k, v in value.items()}
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[int, float]) -> dict[int, float]:
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        if any(not 0 <= i <= INT64_MAX for i in value):
            raise ValueError("logit_bias keys must be token ids: integers from 0 to 2**63 - 1")
        if any(not -100 <= b <= 100 for b in value.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        return value

    @model_validator(mode="after")
    def _lengths_agree(self) -> GenerateParams:
        if self.max_new_tokens is not None and self.max_new_tokens < self.min_new_tokens:
            raise ValueError("max_new_tokens must be at least min_new_tokens")
        return self

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(cls.model_fields)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> GenerateParams:
        """Validate user kwargs: ``UnknownArgument`` for unknown names, ``InvalidRequest`` for bad values."""
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise UnknownArgument(
                f"Keyword argument(s) {', '.join(unknown)} not recognized as generation parameters; "
                f"known: {', '.join(sorted(cls.field_names()))}"
            )
        try:
            return cls.model_validate(kwargs)
        except ValidationError as err:
            raise InvalidRequest(_describe(err)) from None

    def limits_for(self, prompt_length: int, default_max_length: int, context_length: int) -> int:
        """How many new tokens this request may generate after a prompt of ``prompt_length`` tokens.

        Raises ``ContextLengthExceeded`` (an ``InvalidRequest``) when the prompt alone leaves no room, or
        when ``max_new_tokens`` does not fit and ``truncate_max_new_tokens`` is off.
        """
        max_length = min(self.max_length or default_max_length, context_length)
        if prompt_length >= max_length:
            raise ContextLengthExceeded(
                f"prompt has {prompt_length} tokens, which leaves no room under max_length={max_length} "
                f"(model context {context_length})"
            )
        budget = max_length - prompt_length
        if self.max_new_tokens is not None:
            if self.max_new_tokens > budget and not self.truncate_max_new_tokens:
                raise ContextLengthExceeded(
                    f"this model's maximum context length is {max_length} tokens, but {prompt_length + self.max_new_tokens} "
                    f"were requested ({prompt_length} in the prompt, {self.max_new_tokens} to generate); "
                    "shorten the prompt or lower the number of tokens to generate"
                )
            budget = min(budget, self.max_new_tokens)
        return budget


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "parameters"
        parts.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return "invalid generation parameters: " + "; ".join(parts)
