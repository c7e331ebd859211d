"""GenerateMultiplexed: many streamed requests over one call between the load balancer and a replica.

One GenerateStream call per request costs a gRPC message per token of every stream at both ends of
the hop, and on the replica that work shares the GIL with the batching thread. Over one multiplexed
call per replica, the load balancer sends each request (``start``) and each cancellation tagged with a
stream id, and the replica answers with the events of all its streams batched: the updates of one
engine step reach the event loop together, so they leave as one message.

- ``serve_multiplexed`` is the replica's end. Each stream is run by a ``StreamRunner``: the
  replica's hands the engine's updates for the stream to the outbox as the event loop receives them
  (``ReplicaServicer._multiplexed_stream``; the admission, errors and abort-on-exit of GenerateStream).
  The stream's chunks, its end (``done``) or its failure (``error``: the status GenerateStream would
  have ended with) go to a shared outbox that is sent whenever the event loop gets to it.
- ``MultiplexedChannel`` is the load balancer's end for one replica: the call is opened by the first
  stream and opened again by the next stream after it fails. When it fails, every stream on it fails
  with the call's status (a replica that died or restarted: UNAVAILABLE, retried elsewhere by the
  load balancer when no output had been sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from ..wire import generation_pb2 as pb
from .status import RemoteError, rpc_status

log = logging.getLogger(__name__)

# Takes one stream's chunk, in order.
Emit = Callable[[pb.Completion], None]
# Runs one stream: hands its chunks to the Emit as they come, returns when it has ended, raises a
# grpc.RpcError (``RemoteError``) with the status it failed with; cancelled when the caller leaves.
StreamRunner = Callable[[pb.GenerateRequest, Emit], Awaitable[None]]


async def serve_multiplexed(
    run_stream: StreamRunner, requests: AsyncIterator[pb.MultiplexedRequest], context: Any
) -> None:
    """The replica's GenerateMultiplexed: each stream run by ``run_stream``, the events written to
    ``context`` until the caller half-closes and every stream has ended, or the call is cancelled
    (which cancels every stream)."""
    outbox: list[pb.StreamEvent] = []
    wake = asyncio.Event()
    streams: dict[int, asyncio.Task] = {}
    reading = True

    def emit(event: pb.StreamEvent) -> None:
        outbox.append(event)
        wake.set()

    async def run(stream_id: int, request: pb.GenerateRequest) -> None:
        try:
            await run_stream(request, lambda chunk: emit(pb.StreamEvent(stream_id=stream_id, chunk=chunk)))
            emit(pb.StreamEvent(stream_id=stream_id, done=True))
        except grpc.RpcError as err:  # the stream's status (RemoteError)
            emit(pb.StreamEvent(stream_id=stream_id, error=stream_error(err)))
        except Exception as exc:  # as grpc reports a servicer that raised: INTERNAL
            log.exception("multiplexed stream %d failed", stream_id)
            emit(pb.StreamEvent(stream_id=stream_id, error=pb.StreamError(
                code=grpc.StatusCode.INTERNAL.value[0], details=f"internal error: {type(exc).__name__}: {exc}",
            )))  # fmt: skip
        finally:
            streams.pop(stream_id, None)
            wake.set()

    async def read() -> None:
        nonlocal reading
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "start" and message.stream_id not in streams:
                    streams[message.stream_id] = asyncio.ensure_future(run(message.stream_id, message.start))
                elif kind == "cancel" and message.stream_id in streams:
                    streams.pop(message.stream_id).cancel()  # GenerateStream's exit aborts its prompts
        except (grpc.RpcError, asyncio.InvalidStateError) as err:  # the caller went away mid-read
            log.debug("multiplexed call's requests ended: %s", err)
        finally:
            reading = False
            wake.set()

    reader = asyncio.ensure_future(read())
    try:
        while reading or streams or outbox:
            await wake.wait()
            wake.clear()
            if outbox:
                batch = outbox.copy()
                outbox.clear()
                await context.write(pb.MultiplexedEvents(events=batch))
    finally:
        tasks = [reader, *streams.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stream_error(err: grpc.RpcError) -> pb.StreamError:
    """A stream's failure as its error event (the inverse of ``remote_error``)."""
    code, details, name = rpc_status(err)
    return pb.StreamError(code=code.value[0], details=details, error_type=name or "")


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def remote_error(error: pb.StreamError) -> RemoteError:
    """A stream's error event as the failed call it stands for."""
    code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    return RemoteError(code, error.details, error.error_type or None)


class MultiplexedChannel:
    """The load balancer's end of GenerateMultiplexed on one replica (create and use it on the event loop)."""

    def __init__(self, stub: Any, address: str) -> None:
        self._stub = stub
        self.address = address
        self._ids = itertools.count(1)
        self._outgoing: asyncio.Queue[pb.MultiplexedRequest] | None = None  # the open call's requests
        self._reader: asyncio.Task | None = None  # reads the open call; None when no call is open
        self._writer: asyncio.Task | None = None  # writes ``_outgoing`` to the open call
        self._streams: dict[int, asyncio.Queue[pb.StreamEvent | grpc.RpcError]] = {}

    @property
    def is_open(self) -> bool:
        """Whether a call is open (it opens with the first stream, and closes when it fails)."""
        return self._reader is not None

    def open(self, request: pb.GenerateRequest) -> tuple[int, asyncio.Queue[pb.StreamEvent | grpc.RpcError]]:
        """Start ``request`` as a stream: (its id, the queue of its events, ending with a ``done`` or
        ``error`` event, or a ``grpc.RpcError`` when the call fails)."""
        if self._reader is None:
            call = self._stub.GenerateMultiplexed()
            self._outgoing = asyncio.Queue()
            self._writer = asyncio.ensure_future(_write(call, self._outgoing))
            self._reader = asyncio.ensure_future(self._read(call))
        stream_id = next(self._ids)
        events: asyncio.Queue[pb.StreamEvent | grpc.RpcError] = asyncio.Queue()
        self._streams[stream_id] = events
        assert self._outgoing is not None
        self._outgoing.put_nowait(pb.MultiplexedRequest(stream_id=stream_id, start=request))
        return stream_id, events

    def close_stream(self, stream_id: int) -> None:
        """Forget a stream; cancel it on the replica unless it has already ended."""
        if self._streams.pop(stream_id, None) is not None and self._outgoing is not None:
            self._outgoing.put_nowait(pb.MultiplexedRequest(stream_id=stream_id, cancel=True))

    async def close(self) -> None:
        tasks = [task for task in (self._reader, self._writer) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, call: Any) -> None:
        failure: grpc.RpcError = RemoteError(
            grpc.StatusCode.UNAVAILABLE, f"replica {self.address} ended its multiplexed call", "ReplicaUnavailable"
        )
        try:
            async for message in call:
                for event in message.events:
                    events = self._streams.get(event.stream_id)
                    if events is None:  # closed by its reader: the rest of it is not wanted
                        continue
                    if event.WhichOneof("kind") != "chunk":
                        del self._streams[event.stream_id]
                    events.put_nowait(event)
        except grpc.RpcError as err:
            failure = err
        except asyncio.CancelledError:
            failure = RemoteError(grpc.StatusCode.UNAVAILABLE, "the load balancer is closing", "ReplicaUnavailable")
            raise
        finally:
            call.cancel()
            if self._writer is not None:
                self._writer.cancel()
            # why no await from the failure to here: a stream opened meanwhile would join the dead call
            streams, self._streams = self._streams, {}
            self._reader = self._writer = self._outgoing = None
            for events in streams.values():
                events.put_nowait(failure)


async def _write(call: Any, outgoing: asyncio.Queue[pb.MultiplexedRequest]) -> None:
    try:
        while True:
            await call.write(await outgoing.get())
    except (grpc.RpcError, asyncio.InvalidStateError) as err:  # the call ended; its reader reports why
        log.debug("multiplexed call's writes ended: %s", err)
    finally:
        # why: an intercepted call (one with an API key) reads our writes through a task and queue of
        # its own, which wait until told that the writes ended, even after the call is cancelled
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            await call.done_writing()
