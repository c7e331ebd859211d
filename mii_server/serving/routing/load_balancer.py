"""The load balancer: one gRPC front for all replicas (``grpc.aio``; no torch, no GPU).

Splits every request per prompt, round robin over replicas (``RoundRobinRouter``), forwards the
pieces as the same RPC, and reassembles replies in prompt order; streams are merged chunk by chunk.
A replica that fails with UNAVAILABLE before producing output is marked down and its prompts go to
another one. Terminate fans out to every replica, then stops this process.

Every RPC is a task on one event loop, and every upstream call an awaitable on it: no thread is held
per open stream. A caller that goes away cancels its task, which cancels the upstream calls, which
abort the prompts on the replicas.

Health and stats: a monitor task asks every replica's ``Stats`` each ``HEALTH_INTERVAL_S`` (each with
its own deadline, concurrently), marks replicas up or down and keeps their last answer; the ``Stats``
RPC asks the replicas afresh under a short deadline and falls back to that cache for any replica that
does not answer in time, so one frozen replica never stalls health.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from ...errors import MIIServerError, ReplicaUnavailable
from ...wire import convert, generation_pb2_grpc
from ...wire import generation_pb2 as pb
from .. import grpc_common
from ..status import abort_rpc, forward_rpc_error, is_retryable
from .router import RoundRobinRouter, group_by_replica

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.5
STATS_TIMEOUT_S = 1.0  # a replica slower than this to report its stats is reported from the cache
CHAT_TEMPLATE_TIMEOUT_S = 30.0
TERMINATE_TIMEOUT_S = 30.0

HealthListener = Callable[[bool, bool], Coroutine[Any, Any, None]]  # (any up, all up)


class LoadBalancer(generation_pb2_grpc.GenerationServicer):
    """Servicer of the load balancer process (create it inside the running event loop: its channels
    belong to that loop). ``stop_requested`` is set by Terminate."""

    def __init__(self, replica_addresses: list[str], replica_wait_s: float = 0.0) -> None:
        """``replica_wait_s``: how long a request whose every replica failed waits for one to come
        back (a restart) before it fails with ReplicaUnavailable; 0 fails at once."""
        self.addresses = list(replica_addresses)
        self.replica_wait_s = replica_wait_s
        self.router = RoundRobinRouter(len(self.addresses))
        self._channels = [grpc_common.aio_channel(a) for a in self.addresses]
        self._stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in self._channels]
        self._last_stats: list[pb.ReplicaStats | None] = [None] * len(self.addresses)
        self._some_replica_up = asyncio.Event()  # set whenever the monitor sees a replica come up
        self.stop_requested = asyncio.Event()

    # ---- health -----------------------------------------------------------------------------
    async def probe_replicas(self) -> None:
        """Ask every replica's stats once (concurrently) and update the router and the cache."""
        replies = await asyncio.gather(*(self._replica_stats(i) for i in range(len(self._stubs))))
        for i, entry in enumerate(replies):
            self._mark(i, entry is not None and entry.healthy)

    async def monitor(self, on_change: HealthListener, interval_s: float = HEALTH_INTERVAL_S) -> None:
        """Probe replicas until stopped; ``on_change(any_up, all_up)`` after each round."""
        while not self.stop_requested.is_set():
            await self.probe_replicas()
            await on_change(self.router.any_up(), self.router.all_up())
            try:
                await asyncio.wait_for(self.stop_requested.wait(), interval_s)
            except asyncio.TimeoutError:
                pass

    async def _replica_stats(self, replica: int) -> pb.ReplicaStats | None:
        """The replica's own stats entry (cached), or None when it does not answer within the deadline."""
        try:
            reply = await self._stubs[replica].Stats(pb.StatsRequest(), timeout=STATS_TIMEOUT_S)
        except grpc.RpcError:
            return None
        entry = reply.replicas[0] if reply.replicas else pb.ReplicaStats()
        self._last_stats[replica] = entry
        return entry

    def _mark(self, replica: int, up: bool) -> None:
        self.router.mark(replica, up)
        if self.router.any_up():
            self._some_replica_up.set()
        else:
            self._some_replica_up.clear()

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def _assign(self, count: int, failed: set[int]) -> list[int]:
        """``router.assign``; when every replica has failed this request, wait for the health monitor
        to see one come back (a restarted replica) and try them all again, up to ``replica_wait_s``."""
        deadline = time.monotonic() + self.replica_wait_s
        while True:
            try:
                return self.router.assign(count, exclude=failed)
            except ReplicaUnavailable:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                self._some_replica_up.clear()  # why: wait for a fresh sighting, not a stale flag
                try:
                    await asyncio.wait_for(self._some_replica_up.wait(), left)
                except asyncio.TimeoutError:
                    raise ReplicaUnavailable(
                        f"no replica can take the request: every replica is down, and none came back "
                        f"within {self.replica_wait_s:.0f}s"
                    ) from None
                log.info("a replica is back; retrying a request that found every replica down")
                failed.clear()

    def _failed_over(self, replica: int, err: grpc.RpcError, failed: set[int]) -> None:
        log.warning("replica %d unavailable (%s); retrying its prompts elsewhere", replica, err.details())
        self._mark(replica, False)
        failed.add(replica)

    # ---- RPCs -------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateReply:
        log.debug("request_id=%s Generate prompts=%d", request.request_id or "-", len(request.prompts))
        results: list[pb.Completion | None] = [None] * len(request.prompts)
        pending = list(range(len(request.prompts)))
        failed: set[int] = set()
        while pending:
            try:
                groups = group_by_replica(pending, await self._assign(len(pending), failed))
            except MIIServerError as exc:  # ReplicaUnavailable: every replica failed
                await abort_rpc(context, exc)
            tasks = [asyncio.ensure_future(self._generate_on(r, idx, request)) for r, idx in groups.items()]
            pending = []
            try:
                for done in asyncio.as_completed(tasks):
                    replica, indices, outcome = await done
                    if isinstance(outcome, grpc.RpcError):
                        if not is_retryable(outcome):
                            await forward_rpc_error(context, outcome)
                        self._failed_over(replica, outcome, failed)
                        pending.extend(indices)
                        continue
                    for completion in outcome.completions:
                        completion.prompt_index = indices[completion.prompt_index]
                        results[completion.prompt_index] = completion
            finally:
                for task in tasks:
                    task.cancel()  # no-op for finished calls; the others' prompts are aborted upstream
        return pb.GenerateReply(completions=results)

    async def _generate_on(
        self, replica: int, indices: list[int], request: pb.GenerateRequest
    ) -> tuple[int, list[int], pb.GenerateReply | grpc.RpcError]:
        try:
            return replica, indices, await self._stubs[replica].Generate(_sub_request(request, indices))
        except grpc.RpcError as err:
            return replica, indices, err

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Completion]:
        log.debug("request_id=%s GenerateStream prompts=%d", request.request_id or "-", len(request.prompts))
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        pumps: list[asyncio.Task] = []
        failed: set[int] = set()

        async def start(indices: list[int]) -> int:
            groups = group_by_replica(indices, await self._assign(len(indices), failed))
            for replica, idx in groups.items():
                pumps.append(asyncio.ensure_future(self._pump(replica, idx, request, events)))
            return len(groups)

        try:
            active = await start(list(range(len(request.prompts)))) if request.prompts else 0
            while active:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                chunks = []
                for kind, payload in batch:
                    if kind == "chunk":
                        chunks.append(payload)
                    elif kind == "done":
                        active -= 1
                    elif kind == "retry":
                        replica, indices, err = payload
                        self._failed_over(replica, err, failed)
                        active += await start(indices) - 1
                    else:  # "error"
                        await forward_rpc_error(context, payload)
                for chunk in convert.merge_completions(chunks):
                    yield chunk
        except MIIServerError as exc:  # no replica left to try
            await abort_rpc(context, exc)
        finally:
            for pump in pumps:
                pump.cancel()  # no-op once finished; stops upstream when our caller left or failed

    async def _pump(
        self, replica: int, indices: list[int], request: pb.GenerateRequest, events: asyncio.Queue
    ) -> None:
        """Forward one replica's stream into ``events`` with prompt indices mapped back."""
        call = self._stubs[replica].GenerateStream(_sub_request(request, indices))
        produced = False
        try:
            async for chunk in call:
                produced = True
                chunk.prompt_index = indices[chunk.prompt_index]
                events.put_nowait(("chunk", chunk))
        except grpc.RpcError as err:
            if not produced and is_retryable(err):
                events.put_nowait(("retry", (replica, indices, err)))
            else:
                events.put_nowait(("error", err))
            return
        finally:
            call.cancel()  # no-op after a clean end
        events.put_nowait(("done", None))

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        fresh = await asyncio.gather(*(self._replica_stats(i) for i in range(len(self._stubs))))
        reply = pb.StatsReply()
        for i, entry in enumerate(fresh):
            answered = entry is not None
            if entry is None:  # silent now: report what it last said, as not healthy
                entry = self._last_stats[i] or pb.ReplicaStats()
            out = pb.ReplicaStats()
            out.CopyFrom(entry)
            # healthy = the replica has its engine, answers now, AND this balancer routes to it
            out.healthy = answered and entry.healthy and self.router.is_up(i)
            out.replica_index = i
            out.address = self.addresses[i]
            out.prompts_routed = self.router.routed(i)
            reply.replicas.append(out)
        return reply

    async def ApplyChatTemplate(
        self, request: pb.ChatTemplateRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChatTemplateReply:
        """Any one replica renders (they all hold the same tokenizer); UNAVAILABLE ones are skipped."""
        failed: set[int] = set()
        while True:
            try:
                (replica,) = await self._assign(1, failed)
            except MIIServerError as exc:
                await abort_rpc(context, exc)
            try:
                return await self._stubs[replica].ApplyChatTemplate(request, timeout=CHAT_TEMPLATE_TIMEOUT_S)
            except grpc.RpcError as err:
                if not is_retryable(err):
                    await forward_rpc_error(context, err)
                self._failed_over(replica, err, failed)

    async def Terminate(
        self, request: pb.TerminateRequest, context: grpc.aio.ServicerContext
    ) -> pb.TerminateReply:
        log.info("terminate: fanning out to %d replicas", len(self._stubs))
        replies = await asyncio.gather(
            *(stub.Terminate(pb.TerminateRequest(), timeout=TERMINATE_TIMEOUT_S) for stub in self._stubs),
            return_exceptions=True,
        )
        for reply in replies:
            if isinstance(reply, grpc.RpcError):  # a replica already down needs no terminating
                log.info("terminate: a replica did not answer (%s)", reply.code())
        self.stop_requested.set()
        return pb.TerminateReply()


def _sub_request(request: pb.GenerateRequest, indices: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompts=[request.prompts[i] for i in indices], params=request.params, request_id=request.request_id
    )
