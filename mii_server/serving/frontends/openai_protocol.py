"""OpenAI request bodies in, our ``GenerateParams`` out; our chunks in, OpenAI response bodies out.

Plain Python (no Flask, no gRPC), so every mapping rule is unit-tested without a server:

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
from typing import Any

from ...errors import InvalidRequest, MIIServerError
from ...generation.params import GenerateParams
from ...generation.response import FinishReason
from ...wire.types import StreamChunk
from ..status import error_name_of, http_status_of

log = logging.getLogger(__name__)

MAX_N = 128
SEED_MODULUS = 2**63  # GenerateParams.seed's range

_COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_k",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "parallel_tool_calls",
}


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


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {what}, not {value!r}", param=name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = _get(body, name, (int, float), "a number")
    if value is None:
        return None
    if not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise bad_request(f"'{name}' must be in {interval}, not {value}", param=name)
    return float(value)


def _unsupported(name: str, detail: str = "") -> ApiError:
    return bad_request(
        f"'{name}' is not supported by this server{': ' + detail if detail else ''}",
        param=name,
        code="unsupported_parameter",
    )


def parse(body: Any, *, chat: bool, served_model: str) -> Plan:
    """Validate an OpenAI request body (``ApiError`` 400 or 404) into a ``Plan``."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    known = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    ignored = sorted(set(body) - known)
    if ignored:
        log.warning("ignoring unknown request fields: %s", ", ".join(ignored))

    model = _get(body, "model", (str,), "a string")
    if model is not None and model != served_model:
        raise ApiError(
            404, f"The model `{model}` does not exist.", "not_found_error", "model", "model_not_found"
        )

    stream = _get(body, "stream", (bool,), "true or false") or False
    stream_options = _get(body, "stream_options", (dict,), "an object")
    if stream_options is not None and not stream:
        raise bad_request("'stream_options' can only be given when 'stream' is true", param="stream_options")
    include_usage = bool(stream_options and stream_options.get("include_usage"))

    n = _get(body, "n", (int,), "an integer")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be between 1 and {MAX_N}, not {n}", param="n")

    _reject_unsupported(body, chat)

    kwargs: dict[str, Any] = {}
    max_name = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _get(body, max_name, (int,), "an integer")
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions; chat runs to the context's end
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(f"'{max_name}' must be at least 1, not {max_tokens}", param=max_name)
        kwargs["max_new_tokens"] = max_tokens
        kwargs["truncate_max_new_tokens"] = False  # as OpenAI and vLLM: a request past the context is a 400

    temperature = _number(body, "temperature", 0.0, 2.0)
    temperature = 1.0 if temperature is None else temperature
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    if temperature == 0.0:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=temperature, top_p=1.0 if top_p is None else top_p)

    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("'stop' must be a string or a list of strings", param="stop")
        kwargs["stop"] = stop

    top_k = _get(body, "top_k", (int,), "an integer")
    if top_k is not None and top_k > 0:  # vLLM: -1 or 0 disables
        kwargs["top_k"] = top_k
    min_tokens = _get(body, "min_tokens", (int,), "an integer")
    if min_tokens:
        kwargs["min_new_tokens"] = min_tokens
    if _get(body, "ignore_eos", (bool,), "true or false"):
        kwargs["ignore_eos"] = True
    stop_ids = _get(body, "stop_token_ids", (list,), "a list of token ids")
    if stop_ids:
        kwargs["stop_token_ids"] = stop_ids

    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None:
        if not -(2**63) <= seed < 2**64:
            raise bad_request("'seed' must fit in 64 bits", param="seed")
        seed %= SEED_MODULUS

    try:  # every other range check (stop count, min <= max, ...) is GenerateParams'
        GenerateParams.from_kwargs(**kwargs, **({"seed": seed} if seed is not None else {}))
    except InvalidRequest as err:
        raise bad_request(str(err)) from None

    plan = Plan(
        chat=chat,
        model=served_model,
        n=n,
        stream=stream,
        include_usage=include_usage,
        echo=False,
        kwargs=kwargs,
        seed=seed,
    )
    if chat:
        plan.messages = _messages(body.get("messages"))
    else:
        plan.prompts = _prompts(body.get("prompt"))
        plan.echo = bool(_get(body, "echo", (bool,), "true or false"))
    return plan


def _reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    if chat:
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            raise _unsupported("logprobs", "the engine does not return log probabilities")
        if body.get("tools") or body.get("functions"):
            raise _unsupported("tools", "no tool calling")
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise _unsupported("tool_choice", "no tool calling")
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise _unsupported("response_format", "no structured output")
    else:
        if body.get("logprobs") is not None:
            raise _unsupported("logprobs", "the engine does not return log probabilities")
        if body.get("suffix"):
            raise _unsupported("suffix")
        best_of = body.get("best_of")
        if best_of is not None and best_of != (body.get("n") or 1):
            raise _unsupported("best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise _unsupported(name, "only 0 (no penalty)")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias")


def _prompts(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise _unsupported("prompt", "token-id prompts; send text")
    raise bad_request("'prompt' must be a string or a non-empty list of strings", param="prompt")


def _messages(messages: Any) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: only text is understood
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise _unsupported("messages", f"messages[{i}] has a non-text content part")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise bad_request(
                f"messages[{i}].content must be a string or a list of text parts", param="messages"
            )
        out.append((m["role"], content))
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
