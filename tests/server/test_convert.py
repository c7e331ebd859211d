"""Unit: the protobuf <-> dataclass converter round-trips every field, lists and absent values."""

from __future__ import annotations

import pytest

from mii_server.errors import InvalidRequest
from mii_server.generation.params import GenerateParams
from mii_server.generation.response import FinishReason, Response, TokenLogprob, TopLogprob
from mii_server.wire import convert
from mii_server.wire import generation_pb2 as pb
from mii_server.wire.types import ReplicaStats, Tokenized, TokenizerInfo


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
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        min_p=0.05,
        logit_bias={"7": -100, 9: 2.5},
        logprobs=3,
        prompt_logprobs=0,
    )
    msg = convert.params_to_proto(params)
    assert list(msg.stop) == [b"\n\n", b"END"]
    assert dict(msg.logit_bias) == {7: -100.0, 9: 2.5} and msg.HasField("prompt_logprobs")
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
    with pytest.raises(InvalidRequest, match=r"stop\[1\] is not valid UTF-8"):
        convert.params_from_proto(pb.GenerationParams(stop=[b"ok", b"\xff"]))
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        GenerateParams.from_kwargs(max_new_tokens=2**63)  # does not fit the wire's int64


def test_prompts_text_and_token_ids() -> None:
    request = convert.request_to_proto(["hé", [1, 2, 3]], GenerateParams(), request_id="rid-1")
    back = pb.GenerateRequest.FromString(request.SerializeToString())
    assert convert.prompts_from_proto(back.prompts) == ["hé", [1, 2, 3]]
    assert convert.request_id_of(back) == "rid-1"
    with pytest.raises(InvalidRequest, match="prompt 1 is not valid Unicode"):
        convert.request_to_proto(["fine", "\ud800"], GenerateParams())
    with pytest.raises(InvalidRequest, match="prompt 0 is not valid UTF-8"):
        convert.prompts_from_proto([pb.Prompt(text=b"\xc3(")])
    with pytest.raises(InvalidRequest, match="neither text nor token ids"):
        convert.prompts_from_proto([pb.Prompt()])


def test_a_request_id_that_could_forge_log_lines_is_replaced() -> None:
    for bad in ("a\nrequest_id=x", "x" * 129, "tab\t", "\xff"):
        rid = convert.request_id_of(pb.GenerateRequest(request_id=bad.encode("utf-8", "surrogatepass")))
        assert rid != bad and len(rid) == 32 and rid.isalnum()
    assert convert.request_id_of(pb.GenerateRequest(request_id=b"\xff\xfe")).isalnum()


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


def _logprob(token_id: int, *tops: int) -> TokenLogprob:
    return TokenLogprob(token_id, f"t{token_id}", -0.5 * token_id, [TopLogprob(t, f"t{t}", -0.1 * t) for t in tops])


def test_logprobs_and_cached_tokens_round_trip_and_merge() -> None:
    whole = Response(
        "ab", 3, 2, FinishReason.STOP, [5, 6], cached_tokens=2,
        logprobs=[_logprob(5, 1, 2), _logprob(6)], prompt_logprobs=[None, _logprob(8, 3), _logprob(9)],
    )  # fmt: skip
    assert convert.response_from_proto(convert.completion_to_proto(whole, 0)) == whole
    asked_none_yet = Response("", 3, 0, FinishReason.NONE, [], logprobs=[])  # asked for, no token in this chunk
    assert convert.response_from_proto(convert.completion_to_proto(asked_none_yet, 0)).logprobs == []
    plain = convert.response_from_proto(convert.completion_to_proto(Response("x", 1, 1, FinishReason.STOP), 0))
    assert plain.logprobs is None and plain.prompt_logprobs is None
    # a slow reader's queued chunks fold into one: log-probabilities joined, the prompt's kept once
    first = Response("a", 3, 1, FinishReason.NONE, [5], 2, [_logprob(5, 1, 2)], [None, _logprob(8, 3), _logprob(9)])
    second = Response("b", 3, 2, FinishReason.STOP, [6], 2, [_logprob(6)], None)
    (merged,) = convert.merge_completions([convert.completion_to_proto(first, 4), convert.completion_to_proto(second, 4)])
    assert convert.response_from_proto(merged) == whole


def test_tokenizer_messages_round_trip() -> None:
    results = [Tokenized([1, 2], "ab", ["a", "b"]), Tokenized([3], "c")]
    assert convert.tokenized_from_proto(convert.tokenized_to_proto(results)) == results
    info = TokenizerInfo("Fast", "<s>", "</s>", None, None, "", 2048, 384)
    assert convert.tokenizer_info_from_proto(convert.tokenizer_info_to_proto(info)) == info
    chat = convert.chat_request_to_proto([("user", "hé")])
    assert convert.chat_messages_from_proto(chat) == [{"role": "user", "content": "hé"}]
    with pytest.raises(InvalidRequest, match=r"messages\[0\].role"):
        convert.chat_messages_from_proto(pb.ChatTemplateRequest(messages=[pb.ChatMessage(role=b"\x80")]))


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
        cached_prompt_tokens=11,
        model_name="m",
    )
    assert convert.stats_from_proto(convert.stats_to_proto(stats)) == stats
