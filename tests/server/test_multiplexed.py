"""GenerateMultiplexed between the load balancer and its replicas (``serving.multiplexed``): many
streams over one call per replica, each cancelled or failed alone, and a new call after a restart."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from mii_server.errors import CapacityExceeded, InvalidRequest
from mii_server.serving import grpc_common
from mii_server.serving.frontends.client import Client
from mii_server.serving.frontends.loop_thread import LoopThread
from mii_server.serving.multiplexed import remote_error, serve_multiplexed
from mii_server.serving.security import ApiKeys, GrpcSecurity
from mii_server.wire import generation_pb2 as pb
from mii_server.wire import generation_pb2_grpc

from .fakes import ADMIN_TOKEN, start_balancer, start_fake
from .helpers import free_port_block, wait_for


def text_of(client: Client, prompt: str) -> str:
    return "".join(chunk.generated_text for chunk in client.generate_stream([prompt]))


@pytest.fixture()
def one_replica(bg: LoopThread):
    base = free_port_block(2)
    fake, server = bg.run(start_fake("r0", base + 1))
    balancer, front = bg.run(start_balancer([f"127.0.0.1:{base + 1}"], base))
    client = Client(f"127.0.0.1:{base}")
    servers = [server]
    yield client, balancer, fake, servers, base + 1
    client.close()
    bg.run(front.stop(0))
    for s in servers:
        bg.run(s.stop(0))
    bg.run(balancer.close())


def test_concurrent_streams_share_one_call_and_each_gets_its_own_text(one_replica) -> None:
    client, _, fake, _, _ = one_replica
    out: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: out.update({i: text_of(client, f"s{i}-xyz")})) for i in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert out == {i: f"s{i}-xyz@r0" for i in range(16)}
    assert text_of(client, "later") == "later@r0"
    assert fake.multiplexed_calls == 1  # every stream, the later one too, went over the first call


def test_a_stream_cancelled_or_failed_leaves_the_others_on_its_call_going(one_replica) -> None:
    client, _, fake, _, _ = one_replica
    endless = client.generate_stream(["endless"], max_new_tokens=999)
    next(endless)
    with pytest.raises(InvalidRequest, match="prompt 'bad' refused by r0"):
        list(client.generate_stream(["bad"]))  # its error event carries the type and the message
    with pytest.raises(CapacityExceeded, match="no KV blocks left"):
        list(client.generate_stream(["full"]))
    assert text_of(client, "beside") == "beside@r0"
    endless.close()
    wait_for(lambda: fake.cancelled.is_set(), 10, "the replica to see the endless stream cancelled")
    assert text_of(client, "after") == "after@r0"
    assert fake.multiplexed_calls == 1


def test_a_restarted_replica_gets_a_new_call(one_replica, bg: LoopThread) -> None:
    client, balancer, _, servers, port = one_replica
    assert text_of(client, "before") == "before@r0"
    channel = balancer._links[f"127.0.0.1:{port}"].multiplexed
    assert channel.is_open
    bg.run(servers.pop().stop(0))
    wait_for(lambda: not channel.is_open, 10, "the load balancer to see its call fail")
    fresh, server = bg.run(start_fake("r0-again", port))  # the supervisor restarted it
    servers.append(server)
    assert text_of(client, "after") == "after@r0-again"
    assert fresh.multiplexed_calls == 1


def test_a_stream_whose_runner_crashes_fails_alone_with_internal() -> None:
    """``serve_multiplexed`` unit: a runner that raises something other than a status ends its own
    stream with INTERNAL; the stream beside it completes."""

    async def runner(request: pb.GenerateRequest, emit) -> None:
        if request.request_id == b"crash":
            raise KeyError("a bug")
        emit(pb.Completion(generated_text="ok"))

    class Context:
        def __init__(self) -> None:
            self.events: list[pb.StreamEvent] = []

        async def write(self, message: pb.MultiplexedEvents) -> None:
            self.events.extend(message.events)

    async def requests():
        yield pb.MultiplexedRequest(stream_id=1, start=pb.GenerateRequest(request_id=b"crash"))
        yield pb.MultiplexedRequest(stream_id=2, start=pb.GenerateRequest(request_id=b"fine"))

    context = Context()
    asyncio.run(asyncio.wait_for(serve_multiplexed(runner, requests(), context), 5))
    by_stream: dict[int, list[str]] = {}
    for event in context.events:
        by_stream.setdefault(event.stream_id, []).append(event.WhichOneof("kind"))
    assert by_stream == {1: ["error"], 2: ["chunk", "done"]}
    error = remote_error(next(e.error for e in context.events if e.stream_id == 1))
    assert error.code() is grpc.StatusCode.INTERNAL and "KeyError" in error.details()


def test_a_multiplexed_call_without_the_key_is_refused(bg: LoopThread) -> None:
    port = free_port_block(1)
    _, server = bg.run(start_fake("r0", port, security=GrpcSecurity(ApiKeys(["sesame"]), ADMIN_TOKEN)))

    async def call_without_key() -> grpc.StatusCode:
        async with grpc_common.aio_channel(f"127.0.0.1:{port}") as channel:
            call = generation_pb2_grpc.GenerationStub(channel).GenerateMultiplexed()
            await call.write(pb.MultiplexedRequest(stream_id=1, start=pb.GenerateRequest()))
            try:
                async for _ in call:
                    pass
            except grpc.RpcError as err:
                return err.code()
            return grpc.StatusCode.OK

    try:
        assert bg.run(call_without_key()) is grpc.StatusCode.UNAUTHENTICATED
    finally:
        bg.run(server.stop(0))
