"""The OpenAI server's ASGI app with a stand-in client (no gRPC): model ids with slashes through the
official SDK, the body limit on a chunked body, CORS off, route errors, and the retry of a non-streaming
request whose replica died mid-generation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from starlette.testclient import TestClient

from mii_server.errors import ReplicaUnavailable
from mii_server.generation.response import FinishReason
from mii_server.serving.frontends.openai_server import RETRIES, create_app
from mii_server.serving.security import ApiKeys
from mii_server.wire.types import StreamChunk

MODEL = "/tmp/models/llama-3"  # a local path: the id /v1/models lists


class StandInClient:
    """``astream`` yields 'a', 'b', 'c'; the first ``die_after_output`` calls fail after their first
    chunk, as a replica that dies mid-generation; ``die_at_once`` calls fail before any."""

    def __init__(self, die_after_output: int = 0, die_at_once: int = 0) -> None:
        self.die_after_output = die_after_output
        self.die_at_once = die_at_once
        self.calls = 0

    def astream(self, prompts, params, request_id="") -> AsyncIterator[StreamChunk]:
        self.calls += 1
        call = self.calls

        async def chunks() -> AsyncIterator[StreamChunk]:
            if call <= self.die_at_once:
                raise ReplicaUnavailable("every replica is down")
            for n, text in enumerate("abc"):
                yield StreamChunk(text, 2, n + 1, FinishReason.LENGTH if n == 2 else FinishReason.NONE, [n])
                if call <= self.die_after_output:
                    raise ReplicaUnavailable("replica died")

        return chunks()


def _app(client: StandInClient, **kwargs: object) -> TestClient:
    return TestClient(create_app(MODEL, client, ApiKeys([]), **kwargs))  # type: ignore[arg-type]


def test_a_model_id_with_slashes_retrieves_through_the_sdk() -> None:
    http = _app(StandInClient())
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
    assert [m.id for m in api.models.list()] == [MODEL]
    assert api.models.retrieve(MODEL).id == MODEL  # sent as /v1/models/%2Ftmp%2Fmodels%2Fllama-3
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("/tmp/models/other")


def test_a_chunked_body_over_the_limit_is_413() -> None:
    http = _app(StandInClient(), max_body_bytes=4096)
    body = b'{"prompt": "' + b"x" * 8192 + b'"}'
    reply = http.post("/v1/completions", content=iter([body[:3000], body[3000:]]))  # no Content-Length
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert http.post("/v1/completions", content=body).status_code == 413  # with one
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200


def test_cors_off_sends_no_cors_headers_and_route_errors_have_codes() -> None:
    http = _app(StandInClient())
    ask = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
    preflight = http.options("/v1/completions", headers=ask)
    assert preflight.status_code == 405 and preflight.json()["error"]["code"] == "method_not_allowed"
    reply = http.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://a.example"})
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers
    assert http.get("/nothing").json()["error"]["code"] == "not_found"
    any_origin = _app(StandInClient(), allowed_origins=["*"])
    assert any_origin.options("/v1/completions", headers=ask).headers["access-control-allow-origin"] == "*"


def test_a_non_streaming_request_is_sent_again_when_its_replica_died_mid_generation() -> None:
    stand_in = StandInClient(die_after_output=RETRIES)
    reply = _app(stand_in).post("/v1/completions", json={"prompt": "x"})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "abc"  # no partial text kept
    assert reply.json()["usage"]["completion_tokens"] == 3 and stand_in.calls == RETRIES + 1
    # a bounded number of times
    stand_in = StandInClient(die_after_output=RETRIES + 1)
    reply = _app(stand_in).post("/v1/completions", json={"prompt": "x"})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable"
    # a failure before any output was the load balancer's to retry (and it waited): not again here
    stand_in = StandInClient(die_at_once=1)
    assert _app(stand_in).post("/v1/completions", json={"prompt": "x"}).status_code == 503
    assert stand_in.calls == 1
    # a stream has sent its first bytes: the failure is its last event, nothing is sent twice
    stand_in = StandInClient(die_after_output=1)
    events = _app(stand_in).post("/v1/completions", json={"prompt": "x", "stream": True}).text
    assert '"text": "a"' in events and '"code": "unavailable"' in events and stand_in.calls == 1
