"""Unit: the one error map, server side to client side, through a real in-process gRPC call."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from mii_server import errors
from mii_server.serving import grpc_common
from mii_server.serving.frontends.client import Client
from mii_server.serving.frontends.loop_thread import LoopThread
from mii_server.serving.status import (
    abort_rpc,
    error_from_rpc,
    grpc_status_of,
    http_status_of,
    is_transport_failure,
)
from mii_server.wire import generation_pb2 as pb
from mii_server.wire import generation_pb2_grpc

from .helpers import free_port_block

CASES = [
    (errors.UnknownArgument("bad kw"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (errors.InvalidRequest("too long"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (errors.CapacityExceeded("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
    (errors.ReplicaUnavailable("down"), grpc.StatusCode.UNAVAILABLE, 503),
    (errors.EngineDead("dead"), grpc.StatusCode.UNAVAILABLE, 503),
    (errors.DeploymentNotFound("none"), grpc.StatusCode.NOT_FOUND, 404),
    (RuntimeError("bug"), grpc.StatusCode.INTERNAL, 500),
]


@pytest.mark.parametrize(("exc", "code", "http"), CASES)
def test_table(exc: Exception, code: grpc.StatusCode, http: int) -> None:
    assert grpc_status_of(exc) == code
    assert http_status_of(exc) == http


class Raiser(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.exc: Exception = RuntimeError()

    async def Generate(self, request, context):
        await abort_rpc(context, self.exc)


@pytest.fixture()
def bg() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


def test_types_and_messages_survive_the_wire(bg: LoopThread) -> None:
    raiser = Raiser()
    port = free_port_block(1)
    server, _ = bg.run(grpc_common.start_server(raiser, "127.0.0.1", port))
    try:
        stub = generation_pb2_grpc.GenerationStub(grpc_common.channel(f"127.0.0.1:{port}"))
        for exc, code, _ in CASES:
            raiser.exc = exc
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(pb.GenerateRequest())
            assert info.value.code() == code
            assert not is_transport_failure(info.value)  # decided by our server, even when UNAVAILABLE
            back = error_from_rpc(info.value)
            if isinstance(exc, errors.MIIServerError):
                assert type(back) is type(exc) and str(back) == str(exc)
            else:
                assert type(back) is errors.MIIServerError and "bug" in str(back)
    finally:
        bg.run(server.stop(0))


def test_unreachable_server_is_replica_unavailable() -> None:
    port = free_port_block(1)
    stub = generation_pb2_grpc.GenerationStub(grpc_common.channel(f"127.0.0.1:{port}"))
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(), timeout=5)
    err = error_from_rpc(info.value, f"127.0.0.1:{port}")
    assert isinstance(err, errors.ReplicaUnavailable) and f"127.0.0.1:{port}" in str(err)
    assert is_transport_failure(info.value)


def test_a_client_waits_for_an_unreachable_balancer_then_says_how_long() -> None:
    """A call that cannot reach the load balancer waits for it (a restart), here bounded by the
    client's 1 s timeout, then fails saying so."""
    port = free_port_block(1)
    with Client(f"127.0.0.1:{port}", timeout=1) as client, pytest.raises(errors.ReplicaUnavailable) as info:
        client.generate(["hi"], max_new_tokens=1)
    assert f"127.0.0.1:{port} is unreachable" in str(info.value) and "(waited 1 s for it to answer)" in str(info.value)
    with Client(f"127.0.0.1:{port}", timeout=1) as client, pytest.raises(errors.ReplicaUnavailable) as info:
        client.stats()  # health questions do not wait
    assert "waited" not in str(info.value)


def test_second_server_on_a_used_port_fails(bg: LoopThread) -> None:
    port = free_port_block(1)
    server, _ = bg.run(grpc_common.start_server(Raiser(), "127.0.0.1", port))
    try:
        with pytest.raises(OSError, match=str(port)):
            bg.run(grpc_common.start_server(Raiser(), "127.0.0.1", port))
    finally:
        bg.run(server.stop(0))
