"""The load balancer: one gRPC front for all replicas (``grpc.aio``; no torch, no GPU).

Splits every request per prompt, round robin over replicas (``RoundRobinRouter``), forwards the
pieces (Generate as the same RPC; GenerateStream as a stream of the replica's one multiplexed call,
``serving.multiplexed``), and reassembles replies in prompt order; streams are merged chunk by chunk.
A replica that fails with UNAVAILABLE before producing output is marked down and its prompts go to
another one. Terminate fans out to every replica, then stops this process.

The replica set is keyed by address and may change while requests flow (``set_replicas``, fed by
``follow`` from DNS discovery): a new address gets a channel and joins the round robin; a dropped one
takes no new prompts, and its channel stays open until the calls already on it end (its open streams
finish), then closes.

Every RPC is a task on one event loop, and every upstream call an awaitable on it: no thread is held
per open stream. A caller that goes away cancels its task, which cancels the upstream calls, which
abort the prompts on the replicas.

Health and stats: a monitor task asks every replica's ``Stats`` each ``HEALTH_INTERVAL_S`` (each with
its own deadline, concurrently), marks replicas up or down and keeps their last answer; the ``Stats``
RPC asks the replicas afresh under a short deadline and falls back to that cache for any replica that
does not answer in time, so one frozen replica never stalls health. A replica that shows no working
engine for ``stall_timeout_s`` (stats unanswered, e.g. a stopped process; or one engine step running
that long) is hung: it takes no new prompts, and its calls are ended: prompts with no output yet are
retried on another replica, the others end with UNAVAILABLE. It rejoins once it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from ...errors import MIIServerError, ReplicaUnavailable
from ...wire import convert, generation_pb2_grpc
from ...wire import generation_pb2 as pb
from .. import grpc_common
from ..multiplexed import MultiplexedChannel, remote_error
from ..security import ApiKeys, GrpcSecurity
from ..status import RemoteError, abort_rpc, forward_rpc_error, is_retryable
from .discovery import ReplicaDiscovery
from .router import RoundRobinRouter, group_by_replica

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.5
STATS_TIMEOUT_S = 1.0  # a replica slower than this to report its stats is reported from the cache
CHAT_TEMPLATE_TIMEOUT_S = 30.0
TERMINATE_TIMEOUT_S = 30.0

HealthListener = Callable[[bool, bool], Coroutine[Any, Any, None]]  # (any up, all up)


@dataclass
class ReplicaLink:
    """One replica the balancer knows: its channel, its last stats, and how many calls use it."""

    address: str
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationStub
    last_stats: pb.ReplicaStats | None = None
    calls: int = 0  # upstream calls in flight on the channel
    dropped: bool = False  # no longer a member: close the channel once ``calls`` reaches 0
    last_alive: float = field(default_factory=time.monotonic)  # last answer that showed a working engine
    stalled: bool = False  # silent (or stuck in one step) past the stall timeout: its calls were failed over
    work: set[asyncio.Task] = field(default_factory=set)  # generation calls on it (cancelled if it stalls)
    multiplexed: MultiplexedChannel = field(init=False)  # its streamed requests, over one call

    def __post_init__(self) -> None:
        self.multiplexed = MultiplexedChannel(self.stub, self.address)


def replica_stalled(address: str, timeout_s: float) -> RemoteError:
    """What a call on a hung replica ends with: UNAVAILABLE (so prompts with no output are retried)."""
    return RemoteError(
        grpc.StatusCode.UNAVAILABLE,
        f"replica {address} is hung (no progress for {timeout_s:.0f}s); its requests were failed over",
        "ReplicaUnavailable",
    )


class LoadBalancer(generation_pb2_grpc.GenerationServicer):
    """Servicer of the load balancer process (create it inside the running event loop: its channels
    belong to that loop). ``stop_requested`` is set by Terminate."""

    def __init__(
        self,
        replica_addresses: Iterable[str] = (),
        replica_wait_s: float = 0.0,
        stall_timeout_s: float = 20.0,
        security: GrpcSecurity | None = None,
    ) -> None:
        """``replica_wait_s``: how long a request whose every replica failed waits for one to come
        back (a restart, or a new address) before it fails with ReplicaUnavailable; 0 fails at once.
        ``stall_timeout_s``: how long a replica may go without showing a working engine (its stats
        unanswered, or one engine step running) before it counts as hung and its calls are failed over."""
        self.replica_wait_s = replica_wait_s
        self.stall_timeout_s = stall_timeout_s
        self.security = security or GrpcSecurity(ApiKeys([]))  # the key and TLS trust of its replica channels
        self.router = RoundRobinRouter()
        self._links: dict[str, ReplicaLink] = {}
        self._closing: set[asyncio.Task] = set()  # channels of dropped replicas being closed
        self._some_replica_up = asyncio.Event()  # set whenever a replica is seen up (or joins)
        self.stop_requested = asyncio.Event()
        self.waiting_requests = 0  # requests waiting for a replica to come back (or to appear)
        self.set_replicas(replica_addresses)

    @property
    def addresses(self) -> list[str]:
        """The current replica set, in round-robin order."""
        return self.router.members

    # ---- membership ---------------------------------------------------------------------------
    def set_replicas(self, addresses: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make ``addresses`` the replica set; returns (added, removed)."""
        added, removed = self.router.update(addresses)
        for address in added:
            channel = grpc_common.security_aio_channel(address, self.security)
            self._links[address] = ReplicaLink(address, channel, generation_pb2_grpc.GenerationStub(channel))
        for address in removed:
            link = self._links.pop(address)
            link.dropped = True
            if link.calls == 0:
                self._close(link)
        if added:
            self._some_replica_up.set()  # new members start up: a waiting request may try them
        if added or removed:
            log.info(
                "replicas now %s (added %s, dropped %s)",
                ", ".join(self.addresses) or "none", ", ".join(added) or "none", ", ".join(removed) or "none",
            )  # fmt: skip
        return added, removed

    async def follow(self, discovery: ReplicaDiscovery, interval_s: float) -> None:
        """Re-resolve ``discovery`` every ``interval_s`` until stopped, adding and dropping replicas;
        a replica that joins is health-checked at once."""
        while not self.stop_requested.is_set():
            try:
                await asyncio.wait_for(self.stop_requested.wait(), interval_s)
                return
            except asyncio.TimeoutError:
                pass
            added, _ = self.set_replicas(await discovery.resolve())
            await self._probe([self._links[a] for a in added if a in self._links])

    def _close(self, link: ReplicaLink) -> None:
        task = asyncio.ensure_future(_close_link(link))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _release(self, link: ReplicaLink) -> None:
        link.calls -= 1
        if link.dropped and link.calls == 0:
            self._close(link)

    @contextlib.contextmanager
    def _using(self, link: ReplicaLink) -> Iterator[generation_pb2_grpc.GenerationStub]:
        """Hold ``link``'s channel open around an inline call."""
        link.calls += 1
        try:
            yield link.stub
        finally:
            self._release(link)

    def _work(self, link: ReplicaLink, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """``_call`` for a generation call: cancelled (and failed over) if the replica is found hung."""
        task = self._call(link, coro)
        link.work.add(task)
        task.add_done_callback(link.work.discard)
        return task

    def _call(self, link: ReplicaLink, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` (a call on ``link``) as a task that holds the channel open until it ends; the
        count is taken now, before the task starts, and given back even if it is cancelled unstarted."""
        link.calls += 1
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda _: self._release(link))
        return task

    async def close(self) -> None:
        for link in self._links.values():
            await _close_link(link)
        self._links.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # ---- health -----------------------------------------------------------------------------
    async def probe_replicas(self) -> None:
        """Ask every replica's stats once (concurrently) and update the router and the cache."""
        await self._probe(list(self._links.values()))

    async def _probe(self, links: list[ReplicaLink]) -> None:
        replies = await asyncio.gather(*(self._call(link, self._replica_stats(link)) for link in links))
        now = time.monotonic()
        for link, entry in zip(links, replies, strict=True):
            if entry is not None and entry.busy_step_s <= self.stall_timeout_s:
                link.last_alive = now
            hung = now - link.last_alive > self.stall_timeout_s
            if hung and not link.stalled:
                self._stall(link, entry)
            elif not hung and link.stalled:
                link.stalled = False
                log.info("replica %s answers again with a working engine", link.address)
            self._mark(link.address, entry is not None and entry.healthy and not hung)

    def _stall(self, link: ReplicaLink, entry: pb.ReplicaStats | None) -> None:
        """A hung replica: route around it and end its calls (prompts with no output go elsewhere)."""
        what = "does not answer" if entry is None else f"has been in one engine step for {entry.busy_step_s:.0f}s"
        log.error(
            "replica %s %s (stall timeout %.0fs): failing over its %d calls", link.address, what,
            self.stall_timeout_s, len(link.work),
        )  # fmt: skip
        link.stalled = True
        self._mark(link.address, False)
        for task in list(link.work):
            task.cancel()

    async def monitor(self, on_change: HealthListener, interval_s: float = HEALTH_INTERVAL_S) -> None:
        """Probe replicas until stopped; ``on_change(any_up, all_up)`` after each round."""
        while not self.stop_requested.is_set():
            await self.probe_replicas()
            await on_change(self.router.any_up(), self.router.all_up())
            try:
                await asyncio.wait_for(self.stop_requested.wait(), interval_s)
            except asyncio.TimeoutError:
                pass

    async def _replica_stats(self, link: ReplicaLink) -> pb.ReplicaStats | None:
        """The replica's own stats entry (cached), or None when it does not answer within the deadline
        (run it through ``_call``)."""
        try:
            reply = await link.stub.Stats(pb.StatsRequest(), timeout=STATS_TIMEOUT_S)
        except grpc.RpcError:
            return None
        entry = reply.replicas[0] if reply.replicas else pb.ReplicaStats()
        link.last_stats = entry
        return entry

    def _mark(self, address: str, up: bool) -> None:
        self.router.mark(address, up)
        if self.router.any_up():
            self._some_replica_up.set()
        else:
            self._some_replica_up.clear()

    async def _assign(self, count: int, failed: set[str]) -> list[ReplicaLink]:
        """``router.assign``; when every replica has failed this request, wait for the health monitor
        to see one come back (a restarted replica, a new address) and try them all again, up to
        ``replica_wait_s``. Returns the links at once (no await between choosing and using them)."""
        deadline = time.monotonic() + self.replica_wait_s
        while True:
            try:
                hung = {a for a, link in self._links.items() if link.stalled}
                return [self._links[a] for a in self.router.assign(count, exclude=failed | hung)]
            except ReplicaUnavailable:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                self._some_replica_up.clear()  # why: wait for a fresh sighting, not a stale flag
                self.waiting_requests += 1
                try:
                    await asyncio.wait_for(self._some_replica_up.wait(), left)
                except asyncio.TimeoutError:
                    raise ReplicaUnavailable(
                        f"no replica can take the request: every replica is down, and none came back "
                        f"within {self.replica_wait_s:.0f}s"
                    ) from None
                finally:
                    self.waiting_requests -= 1
                log.info("a replica is back; retrying a request that found every replica down")
                failed.clear()

    def _failed_over(self, address: str, err: grpc.RpcError, failed: set[str]) -> None:
        log.warning("replica %s unavailable (%s); retrying its prompts elsewhere", address, err.details())
        self._mark(address, False)
        failed.add(address)

    # ---- RPCs -------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateReply:
        log.debug("request_id=%s Generate prompts=%d", convert.request_id_of(request) or "-", len(request.prompts))
        results: list[pb.Completion | None] = [None] * len(request.prompts)
        pending = list(range(len(request.prompts)))
        failed: set[str] = set()
        while pending:
            try:
                links = await self._assign(len(pending), failed)
            except MIIServerError as exc:  # ReplicaUnavailable: every replica failed
                await abort_rpc(context, exc)
            by_address = {link.address: link for link in links}
            groups = group_by_replica(pending, [link.address for link in links])
            tasks = [
                self._work(by_address[a], self._generate_on(by_address[a], idx, request)) for a, idx in groups.items()
            ]
            pending = []
            try:
                for done in asyncio.as_completed(tasks):
                    address, indices, outcome = await done
                    if isinstance(outcome, grpc.RpcError):
                        if not is_retryable(outcome):
                            await forward_rpc_error(context, outcome)
                        self._failed_over(address, outcome, failed)
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
        self, link: ReplicaLink, indices: list[int], request: pb.GenerateRequest
    ) -> tuple[str, list[int], pb.GenerateReply | grpc.RpcError]:
        try:
            return link.address, indices, await link.stub.Generate(_sub_request(request, indices))
        except grpc.RpcError as err:
            return link.address, indices, err
        except asyncio.CancelledError:
            if not link.stalled:
                raise  # our caller left
            return link.address, indices, replica_stalled(link.address, self.stall_timeout_s)

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Completion]:
        log.debug("request_id=%s GenerateStream prompts=%d", convert.request_id_of(request) or "-", len(request.prompts))
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        pumps: list[asyncio.Task] = []
        failed: set[str] = set()

        async def start(indices: list[int]) -> int:
            links = await self._assign(len(indices), failed)
            by_address = {link.address: link for link in links}
            groups = group_by_replica(indices, [link.address for link in links])
            for address, idx in groups.items():
                link = by_address[address]
                pumps.append(self._work(link, self._pump(link, idx, request, events)))
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
                        address, indices, err = payload
                        self._failed_over(address, err, failed)
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
        self, link: ReplicaLink, indices: list[int], request: pb.GenerateRequest, events: asyncio.Queue
    ) -> None:
        """Forward one replica's stream (over its multiplexed call) into ``events`` with prompt
        indices mapped back."""
        stream_id, inbox = link.multiplexed.open(_sub_request(request, indices))
        produced = False
        try:
            while True:
                batch = [await inbox.get()]
                while not inbox.empty():
                    batch.append(inbox.get_nowait())
                for event in batch:
                    if isinstance(event, grpc.RpcError):  # the multiplexed call failed
                        raise event
                    kind = event.WhichOneof("kind")
                    if kind == "error":
                        raise remote_error(event.error)
                    if kind == "done":
                        events.put_nowait(("done", None))
                        return
                    produced = True
                    chunk = event.chunk
                    chunk.prompt_index = indices[chunk.prompt_index]
                    events.put_nowait(("chunk", chunk))
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                if not link.stalled:
                    raise  # our caller left
                exc = replica_stalled(link.address, self.stall_timeout_s)
            if not produced and is_retryable(exc):
                events.put_nowait(("retry", (link.address, indices, exc)))
            else:
                events.put_nowait(("error", exc))
        finally:
            link.multiplexed.close_stream(stream_id)  # cancels it on the replica unless it ended

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        links = list(self._links.values())
        fresh = await asyncio.gather(*(self._call(link, self._replica_stats(link)) for link in links))
        reply = pb.StatsReply()
        for i, (link, entry) in enumerate(zip(links, fresh, strict=True)):
            answered = entry is not None
            if entry is None:  # silent now: report what it last said, as not healthy
                entry = link.last_stats or pb.ReplicaStats()
            out = pb.ReplicaStats()
            out.CopyFrom(entry)
            # healthy = the replica has its engine, answers now, AND this balancer routes to it
            out.healthy = answered and entry.healthy and self.router.is_up(link.address)
            out.replica_index = i
            out.address = link.address
            out.prompts_routed = self.router.routed(link.address)
            reply.replicas.append(out)
        return reply

    async def ApplyChatTemplate(
        self, request: pb.ChatTemplateRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChatTemplateReply:
        """Any one replica renders (they all hold the same tokenizer); UNAVAILABLE ones are skipped."""
        return await self._on_any_replica("ApplyChatTemplate", request, context)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeReply:
        """Any one replica tokenises (they all hold the same tokenizer)."""
        return await self._on_any_replica("Tokenize", request, context)

    async def TokenizerInfo(
        self, request: pb.TokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizerInfoReply:
        return await self._on_any_replica("TokenizerInfo", request, context)

    async def _on_any_replica(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Forward a unary tokenizer RPC to one replica, round robin; UNAVAILABLE ones are skipped, any
        other failure is the caller's."""
        failed: set[str] = set()
        while True:
            try:
                (link,) = await self._assign(1, failed)
            except MIIServerError as exc:
                await abort_rpc(context, exc)
            with self._using(link) as stub:
                try:
                    return await getattr(stub, method)(request, timeout=CHAT_TEMPLATE_TIMEOUT_S)
                except grpc.RpcError as err:
                    if not is_retryable(err):
                        await forward_rpc_error(context, err)
                    self._failed_over(link.address, err, failed)

    async def Terminate(
        self, request: pb.TerminateRequest, context: grpc.aio.ServicerContext
    ) -> pb.TerminateReply:
        links = list(self._links.values())
        admin = self.security.call_metadata(admin=True)  # this call was let in: it carried the token
        log.info("terminate: fanning out to %d replicas", len(links))

        replies = await asyncio.gather(
            *(self._call(link, link.stub.Terminate(pb.TerminateRequest(), timeout=TERMINATE_TIMEOUT_S, metadata=admin))
              for link in links),
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


async def _close_link(link: ReplicaLink) -> None:
    await link.multiplexed.close()
    await link.channel.close()
