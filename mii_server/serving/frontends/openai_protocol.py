"""OpenAI request bodies in, our ``GenerateParams`` out; our chunks in, OpenAI response bodies out.

Request bodies are pydantic models (strict: ``"5"`` is not a number, ``true`` is not an integer);
plain Python otherwise (no HTTP framework, no gRPC), so every mapping rule is unit-tested without a
server:

- ``temperature`` defaults to 1 and ``top_p`` to 1 (OpenAI's defaults, not MII's); ``temperature=0`` is
  greedy decoding.
- ``n > 1`` with a ``seed`` gives choice ``j`` the seed ``seed + j``: distinct samples, each reproducible.
  Without a seed every choice gets the replica's own per-request seed.
- ``stop`` (string or list) are stop strings; vLLM's extensions ``top_k``, ``min_tokens``, ``ignore_eos``
  and ``stop_token_ids`` are honoured too (the ``openai`` SDK sends them through ``extra_body``).
- What we cannot honour (``logprobs``, penalties, ``logit_bias``, ``suffix``, tools, JSON mode) is a 400 that
  says so, rather than a silent wrong answer; fields we do not know are ignored with a warning.
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
from ...generation.params import GenerateParams
from ...generation.response import FinishReason
from ...wire.types import StreamChunk
from ..status import error_name_of, http_status_of

log = logging.getLogger(__name__)

MAX_N = 128
SEED_MODULUS = 2**63  # GenerateParams.seed's range

Number = Annotated[float, Field(strict=True)]  # strict floats still take ints


class ApiError(Exception):
    """An error with OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
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
        """A short label for metrics."""
        return self.code or self.type


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def api_error_of(exc: BaseException) -> ApiError:
    """Our typed errors (from the replicas, via the status map) in OpenAI's shape."""
    if isinstance(exc, ApiError):
        return exc
    status = http_status_of(exc)
    name = error_name_of(exc)
    if status == 400:
        return ApiError(400, str(exc), "invalid_request_error", None, name)
    if status == 404:
        return ApiError(404, str(exc), "not_found_error", None, name)
    if status == 503:
        kind = "overloaded" if name == "CapacityExceeded" else "unavailable"
        return ApiError(503, str(exc), "service_unavailable_error", None, kind)
    message = str(exc) if isinstance(exc, MIIServerError) else f"internal error: {type(exc).__name__}"
    return ApiError(500, message, "internal_server_error", None, "internal_error")


def _unsupported(name: str, detail: str = "") -> ApiError:
    return bad_request(
        f"'{name}' is not supported by this server{': ' + detail if detail else ''}",
        param=name,
        code="unsupported_parameter",
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
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**64)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM's extensions
    top_k: StrictInt | None = None
    min_tokens: StrictInt | None = Field(default=None, ge=0)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None


class CompletionRequest(_CommonRequest):
    prompt: Any = None  # checked by _prompts: a string or a non-empty list of strings
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
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


def _validation_error(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return bad_request(f"'{where}': {first['msg']} (got {first.get('input')!r})", param=param)


# ---- parsing ------------------------------------------------------------------------------------


@dataclass
class SubRequest:
    """One upstream GenerateStream: its prompts, its params, and the choice index of each prompt."""

    prompts: list[str]
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
    prompts: list[str] = field(default_factory=list)  # completions; chat: filled in after templating
    messages: list[tuple[str, str]] = field(default_factory=list)  # chat: (role, content)
    kwargs: dict[str, Any] = field(default_factory=dict)  # GenerateParams kwargs except the seed
    seed: int | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of_choice(self, choice: int) -> int:
        return choice // self.n

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


def parse(body: Any, *, chat: bool, served_model: str) -> Plan:
    """Validate an OpenAI request body (``ApiError`` 400 or 404) into a ``Plan``."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = ChatCompletionRequest.model_validate(body) if chat else CompletionRequest.model_validate(body)
    except ValidationError as err:
        raise _validation_error(err) from None
    if req.model_extra:
        log.warning("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))
    if req.model is not None and req.model != served_model:
        raise ApiError(404, f"The model `{req.model}` does not exist.", "not_found_error", "model", "model_not_found")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' can only be given when 'stream' is true", param="stream_options")
    _reject_unsupported(req)

    kwargs: dict[str, Any] = {}
    max_name, max_tokens = "max_tokens", req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions; chat runs to the context's end
    if max_tokens is not None:
        kwargs["max_new_tokens"] = max_tokens
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
    if req.ignore_eos:
        kwargs["ignore_eos"] = True
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = list(req.stop_token_ids)
    seed = None if req.seed is None else req.seed % SEED_MODULUS

    try:  # every other range check (stop count, min <= max, ...) is GenerateParams'
        GenerateParams.from_kwargs(**kwargs, **({"seed": seed} if seed is not None else {}))
    except InvalidRequest as err:
        raise bad_request(str(err), param=max_name if "max_" in str(err) else None) from None

    plan = Plan(
        chat=chat,
        model=served_model,
        n=req.n or 1,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        echo=False,
        kwargs=kwargs,
        seed=seed,
    )
    if isinstance(req, ChatCompletionRequest):
        plan.messages = _messages(req.messages)
    else:
        plan.prompts = _prompts(req.prompt)
        plan.echo = bool(req.echo)
    return plan


def _reject_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs or req.top_logprobs is not None:
            raise _unsupported("logprobs", "the engine does not return log probabilities")
        if req.tools or req.functions:
            raise _unsupported("tools", "no tool calling")
        if req.tool_choice not in (None, "none", "auto"):
            raise _unsupported("tool_choice", "no tool calling")
        fmt = req.response_format
        if fmt is not None and fmt.get("type") != "text":
            raise _unsupported("response_format", "no structured output")
    else:
        if req.logprobs is not None:
            raise _unsupported("logprobs", "the engine does not return log probabilities")
        if req.suffix:
            raise _unsupported("suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise _unsupported("best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0.0):
            raise _unsupported(name, "only 0 (no penalty)")
    if req.logit_bias:
        raise _unsupported("logit_bias")


def _prompts(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise _unsupported("prompt", "token-id prompts; send text")
    raise bad_request("'prompt' must be a string or a non-empty list of strings", param="prompt")


def _messages(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: only text is understood
            if any(part.type != "text" or part.text is None for part in content):
                raise _unsupported("messages", f"messages[{i}] has a non-text content part")
            content = "".join(part.text for part in content)
        out.append((m.role, content))
    return out


# ---- responses ----------------------------------------------------------------------------------


def _finish(reason: FinishReason) -> str | None:
    return None if reason is FinishReason.NONE else reason.value


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    generated: int = 0
    prompt_length: int = 0
    finish: FinishReason = FinishReason.NONE
    started: bool = False  # first chunk sent (role delta / echoed prompt)


class ResponseBuilder:
    """Accumulates chunks of one request and renders OpenAI bodies (whole or streamed)."""

    def __init__(self, plan: Plan, request_id: str) -> None:
        self.plan = plan
        self.id = ("chatcmpl-" if plan.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(plan.num_choices)]

    def add(self, choice: int, chunk: StreamChunk) -> None:
        c = self.choices[choice]
        c.text.append(chunk.generated_text)
        c.generated = chunk.generated_length
        c.prompt_length = chunk.prompt_length
        c.finish = chunk.finish_reason

    def usage(self) -> dict[str, int]:
        # a prompt counts once however many samples it gets
        prompt = sum(self.choices[p * self.plan.n].prompt_length for p in range(len(self.plan.prompts)))
        completion = sum(c.generated for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self) -> dict[str, Any]:
        """The non-streaming body, once every choice has finished."""
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.plan.chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": _finish(c.finish),
                    }
                )
            else:
                if self.plan.echo:
                    text = self.plan.prompts[self.plan.prompt_of_choice(i)] + text
                choices.append(
                    {"index": i, "text": text, "logprobs": None, "finish_reason": _finish(c.finish)}
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.plan.chat else "text_completion",
            "created": self.created,
            "model": self.plan.model,
            "choices": choices,
            "usage": self.usage(),
        }

    def chunk(self, choice: int, chunk: StreamChunk) -> list[dict[str, Any]]:
        """The stream bodies for one upstream chunk (after ``add``)."""
        c = self.choices[choice]
        finish = _finish(chunk.finish_reason)
        out = []
        if self.plan.chat:
            if not c.started:
                c.started = True
                out.append(
                    self._chunk_body(
                        {
                            "index": choice,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                )
            if chunk.generated_text or finish:
                delta = {"content": chunk.generated_text} if chunk.generated_text else {}
                out.append(
                    self._chunk_body(
                        {"index": choice, "delta": delta, "logprobs": None, "finish_reason": finish}
                    )
                )
        else:
            text = chunk.generated_text
            if not c.started:
                c.started = True
                if self.plan.echo:
                    text = self.plan.prompts[self.plan.prompt_of_choice(choice)] + text
            if text or finish:
                out.append(
                    self._chunk_body(
                        {"index": choice, "text": text, "logprobs": None, "finish_reason": finish}
                    )
                )
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
