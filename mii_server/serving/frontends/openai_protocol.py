"""OpenAI request bodies in, our ``GenerateParams`` out; our chunks in, OpenAI response bodies out.

Request bodies are pydantic models (strict: ``"5"`` is not a number, ``true`` is not an integer);
plain Python otherwise (no HTTP framework, no gRPC), so every mapping rule is unit-tested without a
server:

- ``temperature`` defaults to 1 and ``top_p`` to 1 (OpenAI's defaults, not MII's); ``temperature=0`` is
  greedy decoding.
- ``n > 1`` with a ``seed`` gives choice ``j`` the seed ``seed + j``: distinct samples, each reproducible.
  Without a seed every choice gets the replica's own per-request seed.
- ``stop`` (string or list) are stop strings; ``presence_penalty``, ``frequency_penalty`` and
  ``logit_bias`` are OpenAI's; vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``,
  ``min_tokens``, ``ignore_eos`` and ``stop_token_ids`` are honoured too (the ``openai`` SDK sends them
  through ``extra_body``).
- ``prompt`` is text, a list of texts, token ids, or a list of token-id lists (the replica checks the
  ids against the vocabulary).
- ``logprobs`` (completions: an int, the alternatives per token; chat: ``logprobs`` + ``top_logprobs``)
  return the engine's raw log-probabilities (``openai_logprobs``). ``echo`` with ``logprobs`` also
  returns the prompt's, which is how lm-evaluation-harness scores log-likelihoods.
- ``max_tokens: 0`` (completions) generates nothing the caller sees: the engine generates one token
  (it always does) and this server drops its text, ids and log-probability, reports 0 completion
  tokens and ``finish_reason: "length"``. With ``echo`` and ``logprobs`` that is the prompt's scores alone.
- The chat role ``developer`` (what current SDKs send) reaches the template as ``system``.
- What we cannot honour (``suffix``, ``best_of != n``, tools, JSON mode, non-text content) is a 400 that
  says so, rather than a silent wrong answer; fields we do not know are ignored with a warning.
- Every error body has a ``code``, never null (``http_common.error_code``'s rule).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from ...errors import InvalidRequest, MIIServerError
from ...generation.params import INT64_MAX, MAX_LOGPROBS, GenerateParams
from ...generation.response import FinishReason
from ...wire.prompts import prompt_list
from ...wire.types import Prompt, StreamChunk, Tokenized
from ..status import http_status_of
from .http_common import INTERNAL_ERROR, error_code
from .openai_logprobs import (
    Position,
    chat_logprobs,
    completion_logprobs,
    generated_positions,
    prompt_positions,
)

log = logging.getLogger(__name__)

MAX_N = 128
SEED_MODULUS = 2**63  # GenerateParams.seed's range

Number = Annotated[float, Field(strict=True)]  # strict floats still take ints
Int64 = Annotated[StrictInt, Field(le=INT64_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]

# OpenAI's codes for request-validation failures, by pydantic error type
UNSUPPORTED_PARAMETER = "unsupported_parameter"
MODEL_NOT_FOUND = "model_not_found"
_MISSING = "missing_required_parameter"
_INVALID_TYPE = "invalid_type"
_INVALID_VALUE = "invalid_value"


class ApiError(Exception):
    """An error with OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str = _INVALID_VALUE,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def reason(self) -> str:
        """A short label for metrics: the code."""
        return self.code


def bad_request(message: str, param: str | None = None, code: str = _INVALID_VALUE) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def api_error_of(exc: BaseException) -> ApiError:
    """Our typed errors (from the replicas, via the status map) in OpenAI's shape."""
    if isinstance(exc, ApiError):
        return exc
    status = http_status_of(exc)
    code = error_code(exc)
    if status == 400:
        return ApiError(400, str(exc), "invalid_request_error", None, code)
    if status == 404:
        return ApiError(404, str(exc), "not_found_error", None, code)
    if status == 503:
        return ApiError(503, str(exc), "service_unavailable_error", None, code)
    message = str(exc) if isinstance(exc, MIIServerError) else f"internal error: {type(exc).__name__}"
    return ApiError(500, message, "internal_server_error", None, INTERNAL_ERROR)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "not_found_error", "model", MODEL_NOT_FOUND)


def _unsupported(name: str, detail: str = "") -> ApiError:
    return bad_request(
        f"'{name}' is not supported by this server{': ' + detail if detail else ''}",
        param=name,
        code=UNSUPPORTED_PARAMETER,
    )


# ---- request bodies -----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class TextPart(BaseModel):
    """A content part of a chat message; only text is understood."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: accepted, not used

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None


class _CommonRequest(BaseModel):
    """Fields both endpoints share (OpenAI's names, and vLLM's extensions)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr | None = None
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[StrictStr, Number] | None = None  # token id (a decimal string) -> -100..100
    # vLLM's extensions
    top_k: Int64 | None = None  # -1 or 0: off
    min_p: Number | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Number | None = Field(default=None, gt=0.0)
    min_tokens: Int64 | None = Field(default=None, ge=0)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[TokenId] | None = None


class CompletionRequest(_CommonRequest):
    prompt: Any = None  # checked by _prompts: text, texts, token ids or token-id lists
    max_tokens: Int64 | None = Field(default=None, ge=0)
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = Field(default=None, ge=1)
    max_completion_tokens: Int64 | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_are_a_list(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty list of {role, content} objects")
        return value


def validation_error(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    kind = first["type"]
    code = _MISSING if kind == "missing" else _INVALID_TYPE if kind.endswith("_type") else _INVALID_VALUE
    return bad_request(f"'{where}': {first['msg']} (got {first.get('input')!r:.200})", param=param, code=code)


# ---- parsing ------------------------------------------------------------------------------------


@dataclass
class SubRequest:
    """One upstream GenerateStream: its prompts, its params, and the choice index of each prompt."""

    prompts: list[Prompt]
    params: GenerateParams
    choice_indices: list[int]


@dataclass
class Plan:
    """A validated OpenAI request."""

    chat: bool
    model: str
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    prompts: list[Prompt] = field(default_factory=list)  # completions; chat: filled in after templating
    messages: list[tuple[str, str]] = field(default_factory=list)  # chat: (role, content)
    kwargs: dict[str, Any] = field(default_factory=dict)  # GenerateParams kwargs except the seed
    seed: int | None = None
    logprobs: int | None = None  # alternatives per token when log-probabilities are asked for, else None
    drop_generated: bool = False  # max_tokens 0: the one token the engine generates is not returned
    # echo: the prompts through the tokenizer (their text, and the first token's), set by the server
    # when ``needs_tokenized_prompts``
    tokenized: list[Tokenized] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of_choice(self, choice: int) -> int:
        return choice // self.n

    @property
    def needs_tokenized_prompts(self) -> bool:
        """Echo needs the prompts' text (token-id prompts) or their first token (echoed log-probabilities)."""
        return self.echo and (self.logprobs is not None or any(not isinstance(p, str) for p in self.prompts))

    def echo_text(self, prompt: int) -> str:
        if self.tokenized is not None:
            return self.tokenized[prompt].text
        text = self.prompts[prompt]
        assert isinstance(text, str), "token-id prompts are tokenized before their text is echoed"
        return text

    def first_token(self, prompt: int) -> str:
        assert self.tokenized is not None, "echoed log-probabilities need the tokenized prompts"
        strings = self.tokenized[prompt].token_strings
        return strings[0] if strings else ""

    def sub_requests(self) -> list[SubRequest]:
        """Choice ``p * n + j`` is sample ``j`` of prompt ``p``. With a seed, sample ``j`` is seeded
        ``seed + j`` (one upstream request per ``j``); without one, all samples share one request."""
        if self.seed is None or self.n == 1:
            params = self._params(self.seed)
            prompts = [p for p in self.prompts for _ in range(self.n)]
            return [SubRequest(prompts, params, list(range(len(prompts))))]
        return [
            SubRequest(
                list(self.prompts),
                self._params((self.seed + j) % SEED_MODULUS),
                [p * self.n + j for p in range(len(self.prompts))],
            )
            for j in range(self.n)
        ]

    def _params(self, seed: int | None) -> GenerateParams:
        kwargs = dict(self.kwargs)
        if seed is not None:
            kwargs["seed"] = seed
        return GenerateParams.from_kwargs(**kwargs)  # validated once already in parse


# OpenAI / vLLM request field -> GenerateParams kwarg, for the fields that map one to one
_SAME_MEANING = {
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_p": "min_p",
    "ignore_eos": "ignore_eos",
}


def parse(body: Any, *, chat: bool, served_model: str) -> Plan:
    """Validate an OpenAI request body (``ApiError`` 400 or 404) into a ``Plan``."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code=_INVALID_TYPE)
    try:
        req = ChatCompletionRequest.model_validate(body) if chat else CompletionRequest.model_validate(body)
    except ValidationError as err:
        raise validation_error(err) from None
    if req.model_extra:
        log.warning("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))
    if req.model is not None and req.model != served_model:
        raise model_not_found(req.model)
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' can only be given when 'stream' is true", param="stream_options")
    _reject_unsupported(req)

    kwargs: dict[str, Any] = {}
    max_name, max_tokens = "max_tokens", req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions; chat runs to the context's end
    drop_generated = max_tokens == 0
    if max_tokens is not None:
        kwargs["max_new_tokens"] = max(max_tokens, 1)  # the engine always generates one (dropped for 0)
        kwargs["truncate_max_new_tokens"] = False  # as OpenAI and vLLM: a request past the context is a 400

    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature == 0.0:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p)
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.top_k is not None and req.top_k > 0:  # vLLM: -1 or 0 disables
        kwargs["top_k"] = req.top_k
    if req.min_tokens:
        kwargs["min_new_tokens"] = req.min_tokens
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = list(req.stop_token_ids)
    for name, ours in _SAME_MEANING.items():
        if getattr(req, name) is not None:
            kwargs[ours] = getattr(req, name)
    if req.logit_bias:
        kwargs["logit_bias"] = dict(req.logit_bias)  # GenerateParams reads the decimal keys as ids
    logprobs = _logprobs(req)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    if echo and logprobs is not None:
        kwargs["prompt_logprobs"] = logprobs
    seed = None if req.seed is None else req.seed % SEED_MODULUS

    try:  # every other range check (stop count, min <= max, logit_bias ids...) is GenerateParams'
        GenerateParams.from_kwargs(**kwargs, **({"seed": seed} if seed is not None else {}))
    except InvalidRequest as err:
        raise bad_request(str(err), param=_param_named_in(str(err), max_name)) from None

    plan = Plan(
        chat=chat,
        model=served_model,
        n=req.n or 1,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        echo=echo,
        kwargs=kwargs,
        seed=seed,
        logprobs=logprobs,
        drop_generated=drop_generated,
    )
    if isinstance(req, ChatCompletionRequest):
        plan.messages = chat_messages(req.messages)
    else:
        plan.prompts = _prompts(req.prompt)
    return plan


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The alternatives per token the engine returns, or None when no log-probabilities are asked for."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _param_named_in(message: str, max_name: str) -> str | None:
    """The request field a GenerateParams message is about (its kwarg names are MII's)."""
    for ours, theirs in (
        ("max_new_tokens", max_name),
        ("min_new_tokens", "min_tokens"),
        ("logit_bias", "logit_bias"),
        ("stop_token_ids", "stop_token_ids"),
        ("stop", "stop"),
        ("seed", "seed"),
    ):
        if ours in message:
            return theirs
    return None


def _reject_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if isinstance(req, ChatCompletionRequest):
        if req.tools or req.functions:
            raise _unsupported("tools", "no tool calling")
        if req.tool_choice not in (None, "none", "auto"):
            raise _unsupported("tool_choice", "no tool calling")
        fmt = req.response_format
        if fmt is not None and fmt.get("type") != "text":
            raise _unsupported("response_format", "no structured output")
    else:
        if req.suffix:
            raise _unsupported("suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise _unsupported("best_of")


def _prompts(prompt: Any) -> list[Prompt]:
    if prompt is None or prompt == []:
        raise bad_request("'prompt' is required: text, a list of texts, token ids or lists of token ids",
                          param="prompt", code=_MISSING)  # fmt: skip
    try:
        return prompt_list(prompt, "prompt")
    except InvalidRequest as err:
        raise bad_request(str(err), param="prompt") from None


def chat_messages(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: only text is understood
            if any(part.type != "text" or part.text is None for part in content):
                raise _unsupported("messages", f"messages[{i}] has a non-text content part")
            content = "".join(part.text for part in content)
        # why: current SDKs send `developer` where templates (Qwen's, Mistral's) know only `system`
        out.append(("system" if m.role == "developer" else m.role, content))
    return out


# ---- responses ----------------------------------------------------------------------------------


def _finish(reason: FinishReason) -> str | None:
    return None if reason is FinishReason.NONE else reason.value


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    positions: list[Position] = field(default_factory=list)  # every log-probability position so far
    generated: int = 0
    prompt_length: int = 0
    cached_tokens: int = 0
    finish: FinishReason = FinishReason.NONE
    started: bool = False  # first chunk seen (role delta / echoed prompt)
    offset: int = 0  # completions: text offset of the next streamed token


@dataclass
class _Delta:
    """What one upstream chunk adds to a choice, as the caller sees it."""

    text: str
    positions: list[Position] | None  # None: no log-probabilities asked for
    finish: FinishReason


class ResponseBuilder:
    """Accumulates chunks of one request and renders OpenAI bodies (whole or streamed)."""

    def __init__(self, plan: Plan, request_id: str) -> None:
        self.plan = plan
        self.id = ("chatcmpl-" if plan.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(plan.num_choices)]

    def add(self, choice: int, chunk: StreamChunk) -> _Delta:
        """Record one upstream chunk of ``choice``; returns what it adds for the caller."""
        plan, c = self.plan, self.choices[choice]
        drop = plan.drop_generated
        text = "" if drop else chunk.generated_text
        prompt = plan.prompt_of_choice(choice)
        if not c.started:
            c.started = True
            if plan.echo:
                text = plan.echo_text(prompt) + text
        positions: list[Position] | None = None
        if plan.logprobs is not None:
            positions = []
            if plan.echo and chunk.prompt_logprobs is not None:
                positions += prompt_positions(plan.first_token(prompt), chunk.prompt_logprobs)
            if chunk.logprobs is not None and not drop:
                positions += generated_positions(chunk.logprobs)
            c.positions += positions
        finish = chunk.finish_reason
        if drop and finish is not FinishReason.NONE:
            finish = FinishReason.LENGTH  # max_tokens 0 is always reached
        c.text.append(text)
        c.generated = 0 if drop else chunk.generated_length
        c.prompt_length = chunk.prompt_length
        c.cached_tokens = chunk.cached_tokens
        c.finish = finish
        return _Delta(text, positions, finish)

    def usage(self) -> dict[str, Any]:
        # a prompt counts once however many samples it gets
        counted = [self.choices[p * self.plan.n] for p in range(len(self.plan.prompts))]
        prompt = sum(c.prompt_length for c in counted)
        completion = sum(c.generated for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in counted)},
        }

    def _logprobs_body(self, positions: list[Position] | None, offset: int) -> tuple[dict[str, Any] | None, int]:
        if positions is None:
            return None, offset
        if self.plan.chat:
            return chat_logprobs(positions), offset
        return completion_logprobs(positions, offset)

    def whole(self) -> dict[str, Any]:
        """The non-streaming body, once every choice has finished."""
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            logprobs, _ = self._logprobs_body(c.positions if self.plan.logprobs is not None else None, 0)
            if self.plan.chat:
                message = {"role": "assistant", "content": text}
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": _finish(c.finish)})
            else:
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": _finish(c.finish)})
        return {
            "id": self.id,
            "object": "chat.completion" if self.plan.chat else "text_completion",
            "created": self.created,
            "model": self.plan.model,
            "choices": choices,
            "usage": self.usage(),
        }

    def chunk(self, choice: int, chunk: StreamChunk) -> list[dict[str, Any]]:
        """Record one upstream chunk and return the stream bodies it makes."""
        first = not self.choices[choice].started
        delta = self.add(choice, chunk)
        c = self.choices[choice]
        finish = _finish(delta.finish)
        logprobs, c.offset = self._logprobs_body(delta.positions, c.offset)
        has_tokens = bool(delta.positions)
        out = []
        if self.plan.chat:
            if first:
                role = {"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}  # fmt: skip
                out.append(self._chunk_body(role))
            if delta.text or finish or has_tokens:
                body = {"content": delta.text} if delta.text else {}
                out.append(self._chunk_body({"index": choice, "delta": body, "logprobs": logprobs, "finish_reason": finish}))
        elif delta.text or finish or has_tokens:
            out.append(self._chunk_body({"index": choice, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}))
        return out

    def usage_chunk(self) -> dict[str, Any]:
        body = self._chunk_body(None)
        body["usage"] = self.usage()
        return body

    def _chunk_body(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
            "created": self.created,
            "model": self.plan.model,
            "choices": [choice] if choice is not None else [],
        }
        if self.plan.include_usage:
            body["usage"] = None
        return body


def models_body(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_body(model, created)]}


def model_body(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "mii-server"}
