"""The REST gateway refuses before a stream starts, with the right status and Retry-After: the real gateway
app, the real Client and load balancer, and fake replicas that refuse ('full' -> CapacityExceeded,
'bad' -> InvalidRequest) or are not there at all."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest

from mii_server.serving.frontends.client import Client
from mii_server.serving.frontends.loop_thread import LoopThread
from mii_server.serving.frontends.rest_gateway import create_app

from .fakes import start_balancer, start_fake
from .helpers import free_port_block


@contextlib.contextmanager
def _rest_app(bg: LoopThread, fakes: int, dead: int, replica_wait_s: float = 0.0) -> Iterator[object]:
    """A REST app over a load balancer with ``fakes`` fake replicas up and ``dead`` addresses nobody
    listens on (marked down by a first health round, as the monitor would)."""
    base = free_port_block(1 + fakes + dead)
    replicas = [bg.run(start_fake(f"r{i}", base + 1 + i))[1] for i in range(fakes)]
    addresses = [f"127.0.0.1:{base + 1 + i}" for i in range(fakes + dead)]
    balancer, server = bg.run(start_balancer(addresses, base, replica_wait_s=replica_wait_s))
    bg.run(balancer.probe_replicas())
    upstream = LoopThread()
    client = Client(f"127.0.0.1:{base}")
    try:
        yield create_app("dep", client, upstream).test_client()
    finally:
        upstream.run(client.aclose())
        upstream.close()
        for s in [server, *replicas]:
            bg.run(s.stop(0))
        bg.run(balancer.close())


@pytest.fixture()
def gateway(bg: LoopThread) -> Iterator[object]:
    """One fake replica up, one address down."""
    with _rest_app(bg, fakes=1, dead=1) as app:
        yield app


@pytest.fixture()
def nobody(bg: LoopThread) -> Iterator[object]:
    """The only replica is down, and the load balancer does not wait for one."""
    with _rest_app(bg, fakes=0, dead=1) as app:
        yield app


def _post(http, body: dict):
    return http.post("/mii/dep", data=json.dumps(body))


@pytest.mark.parametrize("stream", [False, True])
def test_overload_is_503_with_retry_after_before_any_byte(gateway, stream: bool) -> None:
    reply = _post(gateway, {"prompts": ["full"], "stream": stream})
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    assert reply.mimetype == "application/json"  # not an event stream that says 200 first
    assert reply.get_json()["error"] == {"type": "CapacityExceeded", "code": "overloaded", "message": "no KV blocks left"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_prompt_is_400_before_any_byte(gateway, stream: bool) -> None:
    reply = _post(gateway, {"prompts": ["fine", "bad"], "stream": stream})  # one of two prompts is refused
    assert reply.status_code == 400 and "Retry-After" not in reply.headers
    assert reply.mimetype == "application/json"
    error = reply.get_json()["error"]
    assert (error["type"], error["code"]) == ("InvalidRequest", "invalid_value") and "'bad' refused" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_no_replica_is_503_with_retry_after(nobody, stream: bool) -> None:
    reply = _post(nobody, {"prompts": ["a"], "stream": stream})
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    assert reply.get_json()["error"]["code"] == "unavailable"


def test_a_good_stream_still_streams(gateway) -> None:
    reply = _post(gateway, {"prompts": ["ok"], "stream": True})
    assert reply.status_code == 200 and reply.mimetype == "text/event-stream"
    events = [e for e in reply.get_data(as_text=True).split("\n\n") if e]
    assert "".join(json.loads(e.removeprefix("data: "))["generated_text"] for e in events[:-1]) == "ok@r0"
