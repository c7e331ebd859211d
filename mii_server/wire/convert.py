"""The one module that converts between protobuf messages and the project's dataclasses.

Every other module speaks ``GenerateParams``, ``Response``, ``StreamChunk``, ``ReplicaStats``,
``Tokenized`` and ``TokenizerInfo``; only here do ``generation_pb2`` messages get built or read.

Text from callers is ``bytes`` on the wire (see the proto): it is encoded here on the way out (a
Python string with a lone surrogate cannot be UTF-8, ``InvalidRequest``) and decoded here on the way
in (invalid UTF-8 from a hand-built message, ``InvalidRequest`` naming the field), so a bad string is
a clear INVALID_ARGUMENT wherever it enters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from ..errors import InvalidRequest
from ..generation.params import GenerateParams
from ..generation.response import FinishReason, Response, TokenLogprob, TopLogprob
from . import generation_pb2 as pb
from .request_ids import request_id_from
from .types import Prompt, ReplicaStats, StreamChunk, Tokenized, TokenizerInfo

# GenerateParams fields that travel as proto3 `optional` scalars (absent = server default).
_SCALAR_PARAMS = (
    "truncate_max_new_tokens",
    "max_new_tokens",
    "max_length",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "ignore_eos",
    "return_full_text",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logprobs",
    "prompt_logprobs",
)

_FINISH_TO_PB = {
    FinishReason.NONE: pb.FINISH_REASON_NONE,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


# ---- text ---------------------------------------------------------------------------------------


def encode_text(text: str, what: str) -> bytes:
    """``text`` as UTF-8; ``InvalidRequest`` naming ``what`` when it holds a lone surrogate."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequest(
            f"{what} is not valid Unicode: {err.reason} at character {err.start} "
            f"({text[err.start : err.end]!r}); send UTF-8 text"
        ) from None


def decode_text(data: bytes, what: str) -> str:
    """UTF-8 ``data`` as text; ``InvalidRequest`` naming ``what`` when it is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidRequest(
            f"{what} is not valid UTF-8: {err.reason} at byte {err.start} ({data[err.start : err.end]!r})"
        ) from None


def request_id_of(msg: pb.GenerateRequest | pb.ChatTemplateRequest | pb.TokenizeRequest) -> str:
    """The request id to log: the caller's when it is a safe token, else a fresh one (never a forged line)."""
    return request_id_from(msg.request_id.decode("utf-8", "replace"))


# ---- generation ---------------------------------------------------------------------------------


def params_to_proto(params: GenerateParams) -> pb.GenerationParams:
    """Carry every field the caller set explicitly (unset fields stay absent on the wire)."""
    msg = pb.GenerationParams()
    for name in _SCALAR_PARAMS:
        if name in params.model_fields_set and getattr(params, name) is not None:
            setattr(msg, name, getattr(params, name))
    msg.stop.extend(encode_text(s, f"stop[{i}]") for i, s in enumerate(params.stop))
    msg.stop_token_ids.extend(params.stop_token_ids)
    msg.logit_bias.update(params.logit_bias)
    return msg


def params_from_proto(msg: pb.GenerationParams) -> GenerateParams:
    """Rebuild and re-validate; raises ``InvalidRequest`` for out-of-range values and bad UTF-8."""
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _SCALAR_PARAMS if msg.HasField(name)}
    if msg.stop:
        kwargs["stop"] = [decode_text(s, f"stop[{i}]") for i, s in enumerate(msg.stop)]
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    return GenerateParams.from_kwargs(**kwargs)


def prompt_to_proto(prompt: Prompt, index: int) -> pb.Prompt:
    """Text, or token ids (already checked to be int64s by the caller)."""
    if isinstance(prompt, str):
        return pb.Prompt(text=encode_text(prompt, f"prompt {index}"))
    return pb.Prompt(token_ids=pb.TokenIds(ids=prompt))


def prompts_from_proto(prompts: Sequence[pb.Prompt]) -> list[Prompt]:
    """The prompts of a request: text decoded (``InvalidRequest`` for bad UTF-8), token ids as lists."""
    out: list[Prompt] = []
    for i, prompt in enumerate(prompts):
        kind = prompt.WhichOneof("kind")
        if kind == "text":
            out.append(decode_text(prompt.text, f"prompt {i}"))
        elif kind == "token_ids":
            out.append(list(prompt.token_ids.ids))
        else:
            raise InvalidRequest(f"prompt {i} has neither text nor token ids")
    return out


def request_to_proto(
    prompts: Sequence[Prompt], params: GenerateParams, request_id: str = ""
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompts=[prompt_to_proto(p, i) for i, p in enumerate(prompts)],
        params=params_to_proto(params),
        request_id=request_id.encode("utf-8", "replace"),
    )


def _token_logprob_to_proto(entry: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=entry.token_id,
        token=entry.token,
        logprob=entry.logprob,
        top_logprobs=[pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in entry.top_logprobs],
    )


def _token_logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=msg.token_id,
        token=msg.token,
        logprob=msg.logprob,
        top_logprobs=[TopLogprob(t.token_id, t.token, t.logprob) for t in msg.top_logprobs],
    )


def completion_to_proto(response: Response, prompt_index: int) -> pb.Completion:
    msg = pb.Completion(
        prompt_index=prompt_index,
        generated_text=response.generated_text,
        token_ids=list(response.token_ids),
        prompt_length=response.prompt_length,
        generated_length=response.generated_length,
        finish_reason=_FINISH_TO_PB[response.finish_reason],
        cached_tokens=response.cached_tokens,
    )
    if response.logprobs is not None:
        msg.logprobs.SetInParent()  # present even when empty: asked for, no token in this chunk
        msg.logprobs.entries.extend(_token_logprob_to_proto(e) for e in response.logprobs)
    if response.prompt_logprobs is not None:
        msg.prompt_logprobs.SetInParent()
        msg.prompt_logprobs.entries.extend(
            pb.PromptLogprob() if e is None else pb.PromptLogprob(value=_token_logprob_to_proto(e))
            for e in response.prompt_logprobs
        )
    return msg


def _finish_from_proto(value: int) -> FinishReason:
    # UNSPECIFIED only comes from a peer that forgot to set it; treat it as "still going".
    return _FINISH_FROM_PB.get(value, FinishReason.NONE)


def response_from_proto(msg: pb.Completion) -> Response:
    return Response(
        generated_text=msg.generated_text,
        prompt_length=msg.prompt_length,
        generated_length=msg.generated_length,
        finish_reason=_finish_from_proto(msg.finish_reason),
        token_ids=list(msg.token_ids),
        cached_tokens=msg.cached_tokens,
        logprobs=[_token_logprob_from_proto(e) for e in msg.logprobs.entries] if msg.HasField("logprobs") else None,
        prompt_logprobs=[
            _token_logprob_from_proto(e.value) if e.HasField("value") else None for e in msg.prompt_logprobs.entries
        ]
        if msg.HasField("prompt_logprobs")
        else None,
    )


def chunk_from_proto(msg: pb.Completion) -> StreamChunk:
    return StreamChunk(**vars(response_from_proto(msg)), prompt_index=msg.prompt_index)


def reply_from_proto(msg: pb.GenerateReply, num_prompts: int) -> list[Response]:
    """Responses in prompt order; raises ``ValueError`` if the reply does not cover every prompt once."""
    out: list[Response | None] = [None] * num_prompts
    for completion in msg.completions:
        i = completion.prompt_index
        if i >= num_prompts or out[i] is not None:
            raise ValueError(f"reply names prompt {i} twice or out of range (request had {num_prompts})")
        out[i] = response_from_proto(completion)
    missing = [i for i, r in enumerate(out) if r is None]
    if missing:
        raise ValueError(f"reply lacks prompts {missing}")
    return out  # type: ignore[return-value]


def merge_completions(chunks: list[pb.Completion]) -> list[pb.Completion]:
    """Stream chunks that queued up together, folded into one per prompt (text, ids and log-probabilities
    joined, the first prompt log-probabilities kept, the last chunk's lengths and finish reason),
    prompts in order of first appearance: a reader slower than the engine gets fewer, larger messages
    instead of a backlog of one-token ones."""
    if len(chunks) < 2:
        return chunks
    merged: dict[int, pb.Completion] = {}
    for chunk in chunks:
        into = merged.get(chunk.prompt_index)
        if into is None:
            merged[chunk.prompt_index] = chunk
            continue
        into.generated_text += chunk.generated_text
        into.token_ids.extend(chunk.token_ids)
        into.prompt_length = chunk.prompt_length
        into.generated_length = chunk.generated_length
        into.finish_reason = chunk.finish_reason
        into.cached_tokens = chunk.cached_tokens
        if chunk.HasField("logprobs"):
            into.logprobs.SetInParent()
            into.logprobs.entries.extend(chunk.logprobs.entries)
        if chunk.HasField("prompt_logprobs") and not into.HasField("prompt_logprobs"):
            into.prompt_logprobs.CopyFrom(chunk.prompt_logprobs)
    return list(merged.values())


# ---- stats --------------------------------------------------------------------------------------

_STATS_FIELDS = tuple(f.name for f in fields(ReplicaStats))


def stats_to_proto(stats: ReplicaStats) -> pb.ReplicaStats:
    return pb.ReplicaStats(**{name: getattr(stats, name) for name in _STATS_FIELDS})


def stats_from_proto(msg: pb.ReplicaStats) -> ReplicaStats:
    return ReplicaStats(**{name: getattr(msg, name) for name in _STATS_FIELDS})


# ---- chat templates -----------------------------------------------------------------------------


def chat_request_to_proto(
    messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True, request_id: str = ""
) -> pb.ChatTemplateRequest:
    """``messages`` as (role, content) pairs."""
    return pb.ChatTemplateRequest(
        messages=[
            pb.ChatMessage(
                role=encode_text(role, f"messages[{i}].role"), content=encode_text(content, f"messages[{i}].content")
            )
            for i, (role, content) in enumerate(messages)
        ],
        add_generation_prompt=add_generation_prompt,
        request_id=request_id.encode("utf-8", "replace"),
    )


def chat_messages_from_proto(msg: pb.ChatTemplateRequest) -> list[dict[str, str]]:
    """The messages as the dicts a Hugging Face chat template expects (``InvalidRequest`` for bad UTF-8)."""
    return [
        {"role": decode_text(m.role, f"messages[{i}].role"), "content": decode_text(m.content, f"messages[{i}].content")}
        for i, m in enumerate(msg.messages)
    ]


def chat_reply_to_proto(prompt: str) -> pb.ChatTemplateReply:
    return pb.ChatTemplateReply(prompt=prompt)


def chat_prompt_from_proto(msg: pb.ChatTemplateReply) -> str:
    return msg.prompt


# ---- tokenizer ----------------------------------------------------------------------------------


def tokenize_request_to_proto(
    prompts: Sequence[Prompt], *, add_special_tokens: bool, token_strings: bool, request_id: str = ""
) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(
        prompts=[prompt_to_proto(p, i) for i, p in enumerate(prompts)],
        add_special_tokens=add_special_tokens,
        token_strings=token_strings,
        request_id=request_id.encode("utf-8", "replace"),
    )


def tokenized_to_proto(results: Sequence[Tokenized]) -> pb.TokenizeReply:
    return pb.TokenizeReply(
        prompts=[pb.Tokenized(token_ids=r.token_ids, text=r.text, token_strings=r.token_strings) for r in results]
    )


def tokenized_from_proto(msg: pb.TokenizeReply) -> list[Tokenized]:
    return [Tokenized(list(r.token_ids), r.text, list(r.token_strings)) for r in msg.prompts]


_INFO_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_info_to_proto(info: TokenizerInfo) -> pb.TokenizerInfoReply:
    msg = pb.TokenizerInfoReply(
        tokenizer_class=info.tokenizer_class,
        chat_template=info.chat_template,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
    )
    for name in _INFO_TOKENS:
        if getattr(info, name) is not None:
            setattr(msg, name, getattr(info, name))
    return msg


def tokenizer_info_from_proto(msg: pb.TokenizerInfoReply) -> TokenizerInfo:
    tokens = {name: getattr(msg, name) if msg.HasField(name) else None for name in _INFO_TOKENS}
    return TokenizerInfo(
        tokenizer_class=msg.tokenizer_class,
        chat_template=msg.chat_template,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        **tokens,
    )
