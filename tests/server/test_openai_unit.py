"""Unit: OpenAI request mapping (openai_protocol), API keys, and the replica's bounded waiting queue."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mii_server.errors import CapacityExceeded, InvalidRequest
from mii_server.generation.response import FinishReason
from mii_server.replica.servicer import ReplicaServicer
from mii_server.serving.frontends.http_common import ApiKeys, request_id_from
from mii_server.serving.frontends.openai_protocol import ApiError, ResponseBuilder, api_error_of, parse
from mii_server.wire.types import StreamChunk

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
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": 0}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"suffix": "s"}, "suffix"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"stop": 5}, "stop"),
        ({"n": True}, "n"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        _plan(**body)
    assert err.value.status == 400 and err.value.param == param


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
        {"logprobs": True},
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
    assert builder.usage() == {"prompt_tokens": 7, "completion_tokens": 20, "total_tokens": 27}
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
