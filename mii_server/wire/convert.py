"""The one module that converts between protobuf messages and the project's dataclasses.

Every other module speaks ``GenerateParams``, ``Response``, ``StreamChunk`` and ``ReplicaStats``;
only here do ``generation_pb2`` messages get built or read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from ..generation.params import GenerateParams
from ..generation.response import FinishReason, Response
from . import generation_pb2 as pb
from .types import ReplicaStats, StreamChunk

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
)
_LIST_PARAMS = ("stop", "stop_token_ids")

_FINISH_TO_PB = {
    FinishReason.NONE: pb.FINISH_REASON_NONE,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def params_to_proto(params: GenerateParams) -> pb.GenerationParams:
    """Carry every field the caller set explicitly (unset fields stay absent on the wire)."""
    msg = pb.GenerationParams()
    for name in _SCALAR_PARAMS:
        if name in params.model_fields_set and getattr(params, name) is not None:
            setattr(msg, name, getattr(params, name))
    for name in _LIST_PARAMS:
        getattr(msg, name).extend(getattr(params, name))
    return msg


def params_from_proto(msg: pb.GenerationParams) -> GenerateParams:
    """Rebuild and re-validate; raises ``InvalidRequest`` for out-of-range values."""
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _SCALAR_PARAMS if msg.HasField(name)}
    for name in _LIST_PARAMS:
        values = list(getattr(msg, name))
        if values:
            kwargs[name] = values
    return GenerateParams.from_kwargs(**kwargs)


def request_to_proto(
    prompts: Sequence[str], params: GenerateParams, request_id: str = ""
) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompts=list(prompts), params=params_to_proto(params), request_id=request_id)


def completion_to_proto(response: Response, prompt_index: int) -> pb.Completion:
    return pb.Completion(
        prompt_index=prompt_index,
        generated_text=response.generated_text,
        token_ids=list(response.token_ids),
        prompt_length=response.prompt_length,
        generated_length=response.generated_length,
        finish_reason=_FINISH_TO_PB[response.finish_reason],
    )


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


_STATS_FIELDS = tuple(f.name for f in fields(ReplicaStats))


def stats_to_proto(stats: ReplicaStats) -> pb.ReplicaStats:
    return pb.ReplicaStats(**{name: getattr(stats, name) for name in _STATS_FIELDS})


def stats_from_proto(msg: pb.ReplicaStats) -> ReplicaStats:
    return ReplicaStats(**{name: getattr(msg, name) for name in _STATS_FIELDS})


def chat_request_to_proto(
    messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True, request_id: str = ""
) -> pb.ChatTemplateRequest:
    """``messages`` as (role, content) pairs."""
    return pb.ChatTemplateRequest(
        messages=[pb.ChatMessage(role=role, content=content) for role, content in messages],
        add_generation_prompt=add_generation_prompt,
        request_id=request_id,
    )


def chat_messages_from_proto(msg: pb.ChatTemplateRequest) -> list[dict[str, str]]:
    """The messages as the dicts a Hugging Face chat template expects."""
    return [{"role": m.role, "content": m.content} for m in msg.messages]


def chat_reply_to_proto(prompt: str) -> pb.ChatTemplateReply:
    return pb.ChatTemplateReply(prompt=prompt)


def chat_prompt_from_proto(msg: pb.ChatTemplateReply) -> str:
    return msg.prompt


def merge_completions(chunks: list[pb.Completion]) -> list[pb.Completion]:
    """Stream chunks that queued up together, folded into one per prompt (text and ids joined, the last
    chunk's lengths and finish reason), prompts in order of first appearance: a reader slower than
    the engine gets fewer, larger messages instead of a backlog of one-token ones."""
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
    return list(merged.values())
