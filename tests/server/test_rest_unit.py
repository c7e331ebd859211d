"""REST gateway app with a stand-in client: body parsing, status codes, SSE framing."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from mii_server.errors import CapacityExceeded, ReplicaUnavailable
from mii_server.generation.params import GenerateParams
from mii_server.generation.response import FinishReason, Response
from mii_server.serving.frontends.loop_thread import LoopThread
from mii_server.serving.frontends.rest_gateway import create_app
from mii_server.wire.types import StreamChunk


class StandInClient:
    """The gateway's view of a Client: async calls (run on the gateway's upstream loop), stats."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict]] = []

    async def agenerate(self, prompts, request_id="", **kwargs):
        GenerateParams.from_kwargs(**kwargs)  # the real client validates like this
        self.calls.append((prompts, kwargs))
        if prompts == ["overload"]:
            raise CapacityExceeded("busy")
        return [Response(p.upper() if isinstance(p, str) else str(p), 1, 1, FinishReason.STOP, [1]) for p in prompts]

    def agenerate_stream(self, prompts, request_id="", **kwargs):
        GenerateParams.from_kwargs(**kwargs)

        async def chunks():
            if prompts == ["overload"]:
                raise CapacityExceeded("busy")
            for n, c in enumerate("ab"):
                yield StreamChunk(c, 1, n + 1, FinishReason.NONE, [n], prompt_index=0)
            if prompts == ["fails late"]:
                raise CapacityExceeded("replica lost")

        return chunks()

    async def astats(self, timeout=None):
        raise ReplicaUnavailable("no load balancer behind this stand-in")

    def stats(self, timeout=None):
        raise ReplicaUnavailable("no load balancer behind this stand-in")


@pytest.fixture(scope="module")
def upstream() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture()
def http(upstream: LoopThread):
    stand_in = StandInClient()
    return create_app("dep", stand_in, upstream).test_client(), stand_in


def test_plain_request(http) -> None:
    client, stand_in = http
    reply = client.post("/mii/dep", data=json.dumps({"prompts": ["a", "b"], "max_new_tokens": 3}))
    assert reply.status_code == 200
    assert [r["generated_text"] for r in reply.get_json()] == ["A", "B"]
    assert reply.get_json()[0]["finish_reason"] == "stop"
    assert stand_in.calls == [(["a", "b"], {"max_new_tokens": 3})]
    assert (
        client.post("/mii/dep", data=json.dumps({"prompts": "one"})).get_json()[0]["generated_text"] == "ONE"
    )


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("{nope", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"max_new_tokens": 3}', 'lacks \\"prompts\\"'),
        ('{"prompts": [1.5, 2]}', "must be a string or a list of token ids"),
        ('{"prompts": 7}', "must be a string, a list of strings, or token ids"),
        ('{"prompts": [[1, 9223372036854775808]]}', "token id 9223372036854775808"),
        ('{"prompts": ["a"], "stream": "yes"}', "stream"),
        ('{"prompts": ["a"], "max_new_tokns": 3}', "max_new_tokns"),
        ('{"prompts": ["a"], "max_new_tokens": "ten"}', "max_new_tokens"),
        ('{"prompts": ["a"], "top_p": 7}', "top_p"),
    ],
)
def test_bad_requests_are_400_json(http, body: str, fragment: str) -> None:
    client, _ = http
    reply = client.post("/mii/dep", data=body)
    assert reply.status_code == 400
    assert fragment.replace("\\", "") in reply.get_json()["error"]["message"]


def test_other_statuses(http) -> None:
    client, _ = http
    assert client.post("/mii/other", data='{"prompts": ["a"]}').status_code == 404
    reply = client.post("/mii/dep", data='{"prompts": ["overload"]}')
    assert reply.status_code == 503 and reply.get_json()["error"] == {
        "type": "CapacityExceeded",
        "code": "overloaded",
        "message": "busy",
    }
    assert reply.headers["Retry-After"] == "1"
    assert client.get("/mii/dep").status_code == 405
    assert client.get("/healthz").get_json() == {"status": "ok"}


def test_streaming_is_server_sent_events(http) -> None:
    client, _ = http
    reply = client.post("/mii/dep", data='{"prompts": ["a"], "stream": true}')
    assert reply.status_code == 200 and reply.mimetype == "text/event-stream"
    events = [e for e in reply.get_data(as_text=True).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["generated_text"] for c in chunks] == ["a", "b"] and chunks[0]["prompt_index"] == 0


def test_a_refused_stream_gets_its_status_and_a_late_failure_an_error_event(http) -> None:
    client, _ = http
    refused = client.post("/mii/dep", data='{"prompts": ["overload"], "stream": true}')
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.get_json()["error"]["type"] == "CapacityExceeded"
    late = client.post("/mii/dep", data='{"prompts": ["fails late"], "stream": true}')
    assert late.status_code == 200
    events = [e for e in late.get_data(as_text=True).split("\n\n") if e]
    assert events[-2].startswith("event: error\ndata: ") and "replica lost" in events[-2]
    assert events[-1] == "data: [DONE]"


def test_request_id_health_metrics_and_keys(upstream: LoopThread) -> None:
    from mii_server.serving.security import ApiKeys

    stand_in = StandInClient()
    client = create_app("dep", stand_in, upstream).test_client()
    reply = client.post("/mii/dep", data=json.dumps({"prompts": "a"}), headers={"X-Request-Id": "rid-1"})
    assert reply.headers["X-Request-Id"] == "rid-1"
    assert client.get("/health").status_code == 503  # the stand-in has no load balancer behind it
    assert (
        b'mii_server:http_requests_total{route="/mii/<name>",status="200"} 1.0' in client.get("/metrics").data
    )
    locked = create_app("dep", stand_in, upstream, ApiKeys(["k"])).test_client()
    assert locked.post("/mii/dep", data=json.dumps({"prompts": "a"})).status_code == 401
    ok = locked.post("/mii/dep", data=json.dumps({"prompts": "a"}), headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200
    assert locked.get("/healthz").status_code == 200
