"""The load balancer: one gRPC front for all replicas (no torch, no GPU).

Splits every request per prompt, round robin over replicas (``RoundRobinRouter``), forwards the
pieces as the same RPC, and reassembles replies in prompt order; streams are merged chunk by chunk.
A replica that fails with UNAVAILABLE before producing output is marked down and its prompts go to
another one. Terminate fans out to every replica, then stops this process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from ...errors import MIIServerError, ReplicaUnavailable
from ...wire import generation_pb2 as pb
from ...wire import generation_pb2_grpc
from .. import grpc_common
from ..status import abort_rpc, forward_rpc_error, is_retryable
from .router import RoundRobinRouter, group_by_replica

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.5
STATS_TIMEOUT_S = 5.0
TERMINATE_TIMEOUT_S = 30.0


class _CallSet:
    """The upstream calls of one incoming RPC, so that its cancellation cancels all of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[grpc.Future] = []
        self.cancelled = False

    def add(self, call: grpc.Future) -> None:
        with self._lock:
            self._calls.append(call)
            if not self.cancelled:
                return
        call.cancel()  # the client left before this call started

    def cancel_all(self) -> None:
        with self._lock:
            self.cancelled = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()


class LoadBalancer(generation_pb2_grpc.GenerationServicer):
    """Servicer of the load balancer process. ``stop_requested`` is set by Terminate."""

    def __init__(self, replica_addresses: list[str], replica_wait_s: float = 0.0) -> None:
        """``replica_wait_s``: how long a request whose every replica failed waits for one to come
        back (a restart) before it fails with ReplicaUnavailable; 0 fails at once."""
        self.addresses = list(replica_addresses)
        self.replica_wait_s = replica_wait_s
        self.router = RoundRobinRouter(len(self.addresses))
        self._channels = [grpc_common.channel(a) for a in self.addresses]
        self._stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in self._channels]
        self.stop_requested = threading.Event()

    # ---- health -----------------------------------------------------------------------------
    def probe_replicas(self) -> None:
        """Check every replica's health once and update the router."""
        for i, ch in enumerate(self._channels):
            self.router.mark(i, grpc_common.is_serving(ch, timeout=2.0))

    def monitor(self, on_change: Callable[[bool, bool], None], interval_s: float = HEALTH_INTERVAL_S) -> None:
        """Probe replicas until stopped; ``on_change(any_up, all_up)`` after each round."""
        while not self.stop_requested.is_set():
            self.probe_replicas()
            on_change(self.router.any_up(), self.router.all_up())
            self.stop_requested.wait(interval_s)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def _assign(self, count: int, failed: set[int], context: grpc.ServicerContext) -> list[int]:
        """``router.assign``; when every replica has failed this request, wait for the health monitor
        to see one come back (a restarted replica) and try them all again, up to ``replica_wait_s``."""
        deadline = time.monotonic() + self.replica_wait_s
        while True:
            try:
                return self.router.assign(count, exclude=failed)
            except ReplicaUnavailable:
                left = deadline - time.monotonic()
                if left <= 0 or not context.is_active() or not self.router.wait_any_up(left):
                    raise
                log.info("a replica is back; retrying a request that found every replica down")
                failed.clear()

    # ---- RPCs -------------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateReply:
        log.debug("request_id=%s Generate prompts=%d", request.request_id or "-", len(request.prompts))
        calls = _CallSet()
        context.add_callback(calls.cancel_all)
        results: list[pb.Completion | None] = [None] * len(request.prompts)
        pending = list(range(len(request.prompts)))
        failed: set[int] = set()
        while pending:
            try:
                groups = group_by_replica(pending, self._assign(len(pending), failed, context))
            except MIIServerError as exc:  # ReplicaUnavailable: every replica failed
                abort_rpc(context, exc)
            sent = {}
            for replica, indices in groups.items():
                call = self._stubs[replica].Generate.future(_sub_request(request, indices))
                calls.add(call)
                sent[replica] = (call, indices)
            pending = []
            for replica, (call, indices) in sent.items():
                try:
                    reply = call.result()
                except grpc.FutureCancelledError:
                    return pb.GenerateReply()  # our client went away; nobody reads this
                except grpc.RpcError as err:
                    if is_retryable(err) and not calls.cancelled:
                        log.warning(
                            "replica %d unavailable (%s); retrying its prompts elsewhere",
                            replica,
                            err.details(),
                        )
                        self.router.mark(replica, False)
                        failed.add(replica)
                        pending.extend(indices)
                        continue
                    calls.cancel_all()
                    forward_rpc_error(context, err)
                for completion in reply.completions:
                    completion.prompt_index = indices[completion.prompt_index]
                    results[completion.prompt_index] = completion
        return pb.GenerateReply(completions=results)

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Completion]:
        log.debug("request_id=%s GenerateStream prompts=%d", request.request_id or "-", len(request.prompts))
        calls = _CallSet()
        context.add_callback(calls.cancel_all)
        events: queue.Queue = queue.Queue()
        failed: set[int] = set()
        active = 0

        def start(indices: list[int]) -> int:
            groups = group_by_replica(indices, self._assign(len(indices), failed, context))
            for replica, idx in groups.items():
                threading.Thread(
                    target=self._pump, args=(replica, idx, request, calls, events), daemon=True
                ).start()
            return len(groups)

        try:
            if request.prompts:
                active = start(list(range(len(request.prompts))))
            while active:
                kind, payload = events.get()
                if kind == "chunk":
                    yield payload
                elif kind == "done":
                    active -= 1
                elif kind == "retry":
                    replica, indices = payload
                    self.router.mark(replica, False)
                    failed.add(replica)
                    active += start(indices) - 1
                else:  # "error"
                    calls.cancel_all()
                    forward_rpc_error(context, payload)
        except MIIServerError as exc:  # no replica left to try
            calls.cancel_all()
            abort_rpc(context, exc)
        finally:
            calls.cancel_all()  # no-op when all finished; stops upstream when our client left

    def _pump(
        self,
        replica: int,
        indices: list[int],
        request: pb.GenerateRequest,
        calls: _CallSet,
        events: queue.Queue,
    ) -> None:
        """Forward one replica's stream into ``events`` with prompt indices mapped back."""
        call = self._stubs[replica].GenerateStream(_sub_request(request, indices))
        calls.add(call)
        produced = False
        try:
            for chunk in call:
                produced = True
                chunk.prompt_index = indices[chunk.prompt_index]
                events.put(("chunk", chunk))
        except grpc.RpcError as err:
            if not produced and is_retryable(err) and not calls.cancelled:
                events.put(("retry", (replica, indices)))
            else:
                events.put(("error", err))
            return
        events.put(("done", None))

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        pending = [stub.Stats.future(pb.StatsRequest(), timeout=STATS_TIMEOUT_S) for stub in self._stubs]
        reply = pb.StatsReply()
        for i, call in enumerate(pending):
            try:
                entries = list(call.result().replicas)
                entry = entries[0] if entries else pb.ReplicaStats()
                # healthy = the replica has its engine AND this balancer routes to it
                entry.healthy = entry.healthy and self.router.is_up(i)
            except grpc.RpcError:
                entry = pb.ReplicaStats(healthy=False)
            entry.replica_index = i
            entry.address = self.addresses[i]
            entry.prompts_routed = self.router.routed(i)
            reply.replicas.append(entry)
        return reply

    def ApplyChatTemplate(
        self, request: pb.ChatTemplateRequest, context: grpc.ServicerContext
    ) -> pb.ChatTemplateReply:
        """Any one replica renders (they all hold the same tokenizer); UNAVAILABLE ones are skipped."""
        failed: set[int] = set()
        while True:
            try:
                (replica,) = self._assign(1, failed, context)
            except MIIServerError as exc:
                abort_rpc(context, exc)
            try:
                return self._stubs[replica].ApplyChatTemplate(request, timeout=STATS_TIMEOUT_S)
            except grpc.RpcError as err:
                if not is_retryable(err):
                    forward_rpc_error(context, err)
                self.router.mark(replica, False)
                failed.add(replica)

    def Terminate(self, request: pb.TerminateRequest, context: grpc.ServicerContext) -> pb.TerminateReply:
        log.info("terminate: fanning out to %d replicas", len(self._stubs))
        pending = [
            stub.Terminate.future(pb.TerminateRequest(), timeout=TERMINATE_TIMEOUT_S) for stub in self._stubs
        ]
        for call in pending:
            try:
                call.result()
            except grpc.RpcError as err:  # a replica already down needs no terminating
                log.info("terminate: a replica did not answer (%s)", err.code())
        self.stop_requested.set()
        return pb.TerminateReply()


def _sub_request(request: pb.GenerateRequest, indices: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompts=[request.prompts[i] for i in indices], params=request.params, request_id=request.request_id
    )
