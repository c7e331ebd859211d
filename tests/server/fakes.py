"""In-process fake replicas (no torch, ``grpc.aio`` like the real ones): answer with the prompt and their
own name, so routing shows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from mii_server.errors import CapacityExceeded, InvalidRequest
from mii_server.generation.response import FinishReason, Response
from mii_server.serving import grpc_common
from mii_server.serving.multiplexed import Emit, StreamRunner, serve_multiplexed
from mii_server.serving.routing.load_balancer import LoadBalancer
from mii_server.serving.security import ApiKeys, GrpcSecurity
from mii_server.serving.status import ERROR_METADATA_KEY, RemoteError, abort_rpc
from mii_server.wire import convert, generation_pb2_grpc
from mii_server.wire import generation_pb2 as pb

ADMIN_TOKEN = "test-admin-token"


class FakeReplica(generation_pb2_grpc.GenerationServicer):
    """Generate: '<prompt>@<name>'; stream: one chunk per character of that. 'bad' -> InvalidRequest,
    'full' -> CapacityExceeded; max_new_tokens=999 streams until cancelled; 'slow...' streams a chunk
    each 50 ms. ``frozen``: every answer and
    every chunk waits while it is set (what a SIGSTOPped replica looks like from outside)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.prompts: list[str] = []
        self.terminated = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.frozen = False
        self.multiplexed_calls = 0  # GenerateMultiplexed calls opened on it (by load balancers)

    async def _unless_frozen(self) -> None:
        while self.frozen:
            await asyncio.sleep(0.02)

    async def _text(self, prompt: str, context: grpc.aio.ServicerContext) -> str:
        if prompt == "bad":
            await abort_rpc(context, InvalidRequest(f"prompt 'bad' refused by {self.name}"))
        if prompt == "full":
            await abort_rpc(context, CapacityExceeded("no KV blocks left"))
        self.prompts.append(prompt)
        return f"{prompt}@{self.name}"

    async def Generate(self, request, context):
        await self._unless_frozen()
        out = []
        for i, prompt in enumerate(convert.prompts_from_proto(request.prompts)):
            text = await self._text(prompt, context)
            out.append(convert.completion_to_proto(Response(text, len(prompt), len(text), FinishReason.STOP), i))
        return pb.GenerateReply(completions=out)

    async def GenerateStream(self, request, context) -> AsyncIterator[pb.Completion]:
        texts = [await self._text(p, context) for p in convert.prompts_from_proto(request.prompts)]
        if request.params.HasField("max_new_tokens") and request.params.max_new_tokens == 999:
            try:  # endless stream: the test cancels it
                while True:
                    yield convert.completion_to_proto(Response(".", 1, 1, FinishReason.NONE), 0)
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        longest = max((len(t) for t in texts), default=0)
        for step in range(longest):  # interleave prompts, like a real batch
            for i, text in enumerate(texts):
                if step < len(text):
                    done = step == len(text) - 1
                    reason = FinishReason.STOP if done else FinishReason.NONE
                    await self._unless_frozen()
                    if text.startswith("slow"):
                        await asyncio.sleep(0.05)
                    yield convert.completion_to_proto(Response(text[step], 1, step + 1, reason), i)

    async def GenerateMultiplexed(self, request_iterator, context):
        self.multiplexed_calls += 1
        await serve_multiplexed(stream_runner(self.GenerateStream), request_iterator, context)

    async def Stats(self, request, context):
        await self._unless_frozen()
        return pb.StatsReply(replicas=[pb.ReplicaStats(healthy=True, pid=1, prompts_received=len(self.prompts))])

    async def Terminate(self, request, context):
        self.terminated.set()
        return pb.TerminateReply()


class _StreamContext:
    """What GenerateStream uses of its ServicerContext, for one multiplexed stream: ``abort`` ends the
    stream (not the call) with that status."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        name = next((value for key, value in trailing_metadata if key == ERROR_METADATA_KEY), None)
        raise RemoteError(code, details, name)


def stream_runner(generate_stream) -> StreamRunner:
    """A servicer's GenerateStream as a multiplexed stream's runner: its chunks emitted, its abort raised."""

    async def run(request: pb.GenerateRequest, emit: Emit) -> None:
        async for chunk in generate_stream(request, _StreamContext()):
            emit(chunk)

    return run


async def start_fake(
    name: str, port: int, host: str = "127.0.0.1", security: GrpcSecurity | None = None
) -> tuple[FakeReplica, grpc.aio.Server]:
    """A fake replica that, as a real one does, takes Terminate only with the admin token."""
    fake = FakeReplica(name)
    security = security or GrpcSecurity(ApiKeys([]), ADMIN_TOKEN)
    server, health = await grpc_common.start_server(fake, host, port, security)
    await grpc_common.set_serving(health, True)
    return fake, server


async def start_balancer(
    addresses: list[str],
    port: int,
    replica_wait_s: float = 0.0,
    stall_timeout_s: float = 20.0,
    security: GrpcSecurity | None = None,
):
    """A load balancer over ``addresses`` serving on 127.0.0.1:``port`` (no health monitor: tests drive it).
    Its security defaults to no API key and the admin token ``ADMIN_TOKEN``."""
    security = security or GrpcSecurity(ApiKeys([]), ADMIN_TOKEN)
    balancer = LoadBalancer(addresses, replica_wait_s=replica_wait_s, stall_timeout_s=stall_timeout_s, security=security)
    server, health = await grpc_common.start_server(balancer, "127.0.0.1", port, security)
    await grpc_common.set_serving(health, True)
    return balancer, server
