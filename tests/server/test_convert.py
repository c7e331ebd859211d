"""Unit: the protobuf <-> dataclass converter round-trips every field, lists and absent values."""

from __future__ import annotations

import pytest

from mii_server.errors import InvalidRequest
from mii_server.generation.params import GenerateParams
from mii_server.generation.response import FinishReason, Response
from mii_server.wire import convert
from mii_server.wire import generation_pb2 as pb
from mii_server.wire.types import ReplicaStats


def test_params_round_trip_with_lists_and_exact_floats() -> None:
    params = GenerateParams.from_kwargs(
        max_new_tokens=7,
        do_sample=False,
        top_p=0.9,
        temperature=0.7,
        top_k=5,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 3],
        seed=2**40,
        ignore_eos=True,
        min_new_tokens=1,
        return_full_text=True,
        max_length=99,
    )
    msg = convert.params_to_proto(params)
    assert list(msg.stop) == ["\n\n", "END"]
    assert msg.top_p == 0.9  # a double: no float32 rounding as in MII
    back = convert.params_from_proto(pb.GenerationParams.FromString(msg.SerializeToString()))
    assert back == params


def test_absent_values_stay_absent() -> None:
    msg = convert.params_to_proto(GenerateParams.from_kwargs(max_new_tokens=3))
    assert msg.HasField("max_new_tokens")
    assert not msg.HasField("temperature") and not msg.HasField("do_sample") and not msg.HasField("seed")
    assert convert.params_from_proto(msg) == GenerateParams.from_kwargs(max_new_tokens=3)
    # explicit false/zero differs from absent
    msg = convert.params_to_proto(GenerateParams.from_kwargs(do_sample=False, min_new_tokens=0))
    assert msg.HasField("do_sample") and msg.do_sample is False
    assert msg.HasField("min_new_tokens")


def test_out_of_range_values_from_the_wire_are_rejected() -> None:
    with pytest.raises(InvalidRequest, match="top_p"):
        convert.params_from_proto(pb.GenerationParams(top_p=3.0))


def test_completion_round_trip_and_reply_order() -> None:
    a = Response("hello", 3, 2, FinishReason.STOP, [5, 6])
    b = Response("", 4, 0, FinishReason.LENGTH, [])
    reply = pb.GenerateReply(
        completions=[convert.completion_to_proto(b, 1), convert.completion_to_proto(a, 0)]
    )
    assert convert.reply_from_proto(reply, 2) == [a, b]
    chunk = convert.chunk_from_proto(
        convert.completion_to_proto(Response("x", 1, 1, FinishReason.NONE, [9]), 4)
    )
    assert chunk.prompt_index == 4 and chunk.finish_reason is FinishReason.NONE and chunk.token_ids == [9]
    assert isinstance(chunk, Response)


def test_reply_must_cover_every_prompt_once() -> None:
    c = convert.completion_to_proto(Response("a", 1, 1, FinishReason.STOP), 0)
    with pytest.raises(ValueError, match="lacks"):
        convert.reply_from_proto(pb.GenerateReply(completions=[c]), 2)
    with pytest.raises(ValueError, match="twice"):
        convert.reply_from_proto(pb.GenerateReply(completions=[c, c]), 2)


def test_stats_round_trip() -> None:
    stats = ReplicaStats(
        replica_index=1,
        address="h:1",
        healthy=True,
        pid=42,
        prompts_received=3,
        prompts_routed=4,
        running=1,
        waiting=2,
        free_blocks=5,
        total_blocks=6,
        requests_finished=7,
        prompt_tokens=8,
        generated_tokens=9,
        preemptions=10,
    )
    assert convert.stats_from_proto(convert.stats_to_proto(stats)) == stats
