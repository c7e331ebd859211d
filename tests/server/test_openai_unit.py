"""Unit: OpenAI request mapping (openai_protocol), API keys, and the replica's bounded waiting queue."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mii_server.errors import CapacityExceeded, InvalidRequest
from mii_server.generation.response import FinishReason, TokenLogprob, TopLogprob
from mii_server.replica.servicer import ReplicaServicer
from mii_server.serving.frontends.http_common import request_id_from
from mii_server.serving.frontends.openai_protocol import ApiError, ResponseBuilder, api_error_of, parse
from mii_server.serving.security import ApiKeys
from mii_server.wire.types import StreamChunk, Tokenized

MODEL = "m"


def _plan(chat: bool = False, **body: object):
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "p"}
    return parse({**base, **body}, chat=chat, served_model=MODEL)


def test_openai_defaults_differ_from_mii() -> None:
    (sub,) = _plan().sub_requests()
    p = sub.params
    assert (p.do_sample, p.temperature, p.top_p, p.max_new_tokens) == (True, 1.0, 1.0, 16)
    chat = _plan(chat=True).sub_requests()[0].params
    assert chat.max_new_tokens is None  # chat runs to the context's end


def test_temperature_zero_is_greedy_and_extensions_map() -> None:
    p = _plan(
        temperature=0, top_k=5, min_tokens=2, ignore_eos=True, stop="x", stop_token_ids=[3]
    ).sub_requests()
    params = p[0].params
    assert params.do_sample is False
    assert (params.top_k, params.min_new_tokens, params.ignore_eos, params.stop, params.stop_token_ids) == (
        5, 2, True, ["x"], [3],
    )  # fmt: skip


def test_n_with_seed_seeds_each_choice() -> None:
    subs = _plan(prompt=["a", "b"], n=3, seed=10).sub_requests()
    assert [s.params.seed for s in subs] == [10, 11, 12]
    assert [s.choice_indices for s in subs] == [[0, 3], [1, 4], [2, 5]]
    (one,) = _plan(prompt=["a", "b"], n=2).sub_requests()  # no seed: one request, prompts repeated
    assert one.prompts == ["a", "a", "b", "b"] and one.choice_indices == [0, 1, 2, 3]
    assert _plan(seed=-1).seed == 2**63 - 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"x": 2}}, "logit_bias"),
        ({"logit_bias": {"1": 200}}, "logit_bias"),
        ({"suffix": "s"}, "suffix"),
        ({"prompt": 123}, "prompt"),
        ({"prompt": [[1, -2]]}, "prompt"),
        ({"prompt": [[1, 2**63]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"stop": 5}, "stop"),
        ({"n": True}, "n"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        _plan(**body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.code in {"invalid_value", "invalid_type", "missing_required_parameter", "unsupported_parameter"}


def test_unknown_model_is_404_and_unknown_fields_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ApiError) as err:
        _plan(model="other")
    assert (err.value.status, err.value.param, err.value.code) == (404, "model", "model_not_found")
    assert _plan(model=MODEL, whatever=1).prompts == ["p"]
    assert "whatever" in caplog.text


def test_chat_messages_and_unsupported_features() -> None:
    plan = _plan(
        chat=True,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
    )
    assert plan.messages == [("user", "ab")]
    for body in (
        {"tools": [{"type": "function"}]},
        {"response_format": {"type": "json_object"}},
        {"top_logprobs": 2},  # needs logprobs: true
        {"logprobs": 1},  # a bool in chat
    ):
        with pytest.raises(ApiError):
            _plan(chat=True, **body)
    with pytest.raises(ApiError):
        _plan(chat=True, messages=[])


def test_error_statuses_follow_the_status_map() -> None:
    assert api_error_of(InvalidRequest("x")).status == 400
    overloaded = api_error_of(CapacityExceeded("busy"))
    assert (overloaded.status, overloaded.code) == (503, "overloaded")
    assert api_error_of(RuntimeError("boom")).status == 500


def test_usage_counts_each_prompt_once() -> None:
    plan = _plan(prompt=["a", "b"], n=2)
    builder = ResponseBuilder(plan, "rid")
    for choice in range(4):
        builder.add(choice, StreamChunk("t", prompt_length=3 + choice // 2, generated_length=5,
                                        finish_reason=FinishReason.LENGTH))  # fmt: skip
    assert builder.usage() == {
        "prompt_tokens": 7,
        "completion_tokens": 20,
        "total_tokens": 27,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert builder.whole()["id"] == "cmpl-rid"


def test_api_keys() -> None:
    keys = ApiKeys.load(environ={"MII_SERVER_API_KEY": "k1, k2"})
    assert keys.required
    assert keys.allows("Bearer k1") and keys.allows("bearer k2")
    assert not keys.allows("Bearer k3") and not keys.allows(None) and not keys.allows("k1")
    assert ApiKeys.load(environ={}).allows(None)  # no key configured: open


def test_api_keys_from_file(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nfilekey\n")
    assert ApiKeys.load(str(path), environ={}).allows("Bearer filekey")
    with pytest.raises(InvalidRequest):
        ApiKeys.load(str(tmp_path / "missing"), environ={})


def test_request_ids() -> None:
    assert request_id_from("abc-123") == "abc-123"
    assert len(request_id_from("bad id with spaces")) == 32
    assert len(request_id_from(None)) == 32


def test_replica_refuses_when_the_waiting_queue_is_full() -> None:
    servicer = ReplicaServicer(0, "x:1", max_queued_requests=2)
    driver = SimpleNamespace(stats=lambda: SimpleNamespace(running=1))
    servicer._outstanding = 3  # 1 running + 2 waiting
    with pytest.raises(CapacityExceeded, match="overloaded"):
        servicer._admit(driver, 1)
    servicer._outstanding = 2  # 1 running + 1 waiting
    servicer._admit(driver, 1)
    ReplicaServicer(0, "x:1", max_queued_requests=None)._admit(driver, 10_000)


def test_sampling_controls_and_logprobs_map_to_generate_params() -> None:
    (sub,) = _plan(
        presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": -100}, min_p=0.1, repetition_penalty=1.2,
        logprobs=2,
    ).sub_requests()  # fmt: skip
    p = sub.params
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.min_p, p.repetition_penalty) == (
        0.5, -1.0, {7: -100.0}, 0.1, 1.2,
    )  # fmt: skip
    assert (p.logprobs, p.prompt_logprobs) == (2, None)
    echo = _plan(logprobs=1, echo=True, max_tokens=0)
    assert echo.sub_requests()[0].params.prompt_logprobs == 1
    assert echo.drop_generated and echo.sub_requests()[0].params.max_new_tokens == 1  # generated, then dropped
    assert echo.needs_tokenized_prompts and not _plan(echo=True).needs_tokenized_prompts
    assert _plan(echo=True, prompt=[1, 2]).needs_tokenized_prompts  # the text of token ids is the replica's
    chat = _plan(chat=True, logprobs=True, top_logprobs=3).sub_requests()[0].params
    assert chat.logprobs == 3 and chat.prompt_logprobs is None
    assert _plan(chat=True, logprobs=True).sub_requests()[0].params.logprobs == 0
    assert _plan(chat=True, logprobs=False).sub_requests()[0].params.logprobs is None


def test_the_developer_role_is_system() -> None:
    plan = _plan(chat=True, messages=[{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}])
    assert plan.messages == [("system", "d"), ("user", "u")]


def _lp(token: str, logprob: float, *tops: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(ord(token[0]), token, logprob, [TopLogprob(ord(t[0]), t, v) for t, v in tops])


def test_echoed_prompt_logprobs_in_the_completions_shape() -> None:
    plan = _plan(prompt="abc", logprobs=1, echo=True, max_tokens=0)
    plan.tokenized = [Tokenized([1, 2, 3], "abc", ["a", "b", "c"])]
    builder = ResponseBuilder(plan, "rid")
    prompt = [None, _lp("b", -1.0, ("x", -0.5)), _lp("c", float("-inf"), ("c", -2.0))]
    builder.add(0, StreamChunk("Z", 3, 1, FinishReason.STOP, [9], 0, [_lp("Z", -0.1, ("Z", -0.1))], prompt))
    (choice,) = builder.whole()["choices"]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"  # max_tokens 0: nothing generated
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [None, -1.0, -9999.0],  # JSON has no infinity: the floor
        "top_logprobs": [None, {"b": -1.0, "x": -0.5}, {"c": -9999.0}],  # the chosen token is always there
        "text_offset": [0, 1, 2],
    }
    assert builder.usage()["completion_tokens"] == 0


def test_streamed_completion_logprobs_continue_the_text_offsets() -> None:
    plan = _plan(prompt="p", logprobs=0, stream=True)
    builder = ResponseBuilder(plan, "rid")
    (first,) = builder.chunk(0, StreamChunk("he", 1, 1, FinishReason.NONE, [1], 0, [_lp("he", -1.0)]))
    (second,) = builder.chunk(0, StreamChunk("y", 1, 2, FinishReason.LENGTH, [2], 0, [_lp("y", -2.0)]))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second["choices"][0]["logprobs"] == {
        "tokens": ["y"], "token_logprobs": [-2.0], "top_logprobs": [{"y": -2.0}], "text_offset": [2],
    }  # fmt: skip


def test_chat_logprobs_shape() -> None:
    plan = _plan(chat=True, logprobs=True, top_logprobs=1)
    plan.prompts = ["rendered"]
    builder = ResponseBuilder(plan, "rid")
    builder.add(0, StreamChunk("é", 4, 1, FinishReason.STOP, [5], 2, [_lp("é", -0.3, ("e", -0.2))]))
    body = builder.whole()
    assert body["choices"][0]["logprobs"] == {
        "content": [
            {"token": "é", "logprob": -0.3, "bytes": [195, 169],
             "top_logprobs": [{"token": "e", "logprob": -0.2, "bytes": [101]}]},
        ],
        "refusal": None,
    }  # fmt: skip
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
