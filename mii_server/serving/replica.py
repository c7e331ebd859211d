"""The replica's gRPC servicer (rank 0): every RPC's prompts go to one shared ``EngineDriver``.

Concurrent RPCs from any number of clients land in the same continuous batch, because the driver
batches everything submitted from any thread. A cancelled RPC (client gone, deadline, load
balancer cancelling) aborts its unfinished prompts, which frees their KV blocks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from ..errors import EngineDead
from ..wire import convert, generation_pb2_grpc
from ..wire import generation_pb2 as pb
from .rpc_requests import RpcRequests
from .status import abort_rpc
from .types import ReplicaStats

if TYPE_CHECKING:
    from .engine_driver import EngineDriver

log = logging.getLogger(__name__)


class ReplicaServicer(generation_pb2_grpc.GenerationServicer):
    """Serves Generate/GenerateStream/Stats/Terminate over an engine driver attached once loaded."""

    def __init__(self, replica_index: int, address: str) -> None:
        self.replica_index = replica_index
        self.address = address
        self.stop_requested = threading.Event()
        self._driver: EngineDriver | None = None
        self._lock = threading.Lock()
        self._received = 0  # prompts accepted since this process started

    def attach(self, driver: EngineDriver) -> None:
        """Start taking requests (called once the model has loaded)."""
        self._driver = driver

    # ---- RPCs -------------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateReply:
        requests = self._start(request, context)
        for _, update in requests.updates():
            if update.error is not None:
                requests.abort_unfinished()
                abort_rpc(context, update.error)
        return pb.GenerateReply(
            completions=[
                convert.completion_to_proto(requests.result(i), i) for i in range(len(request.prompts))
            ]
        )

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Completion]:
        requests = self._start(request, context)
        try:
            for index, update in requests.updates():
                if update.error is not None:
                    requests.abort_unfinished()
                    abort_rpc(context, update.error)
                yield convert.completion_to_proto(update.response, index)
        finally:
            requests.abort_unfinished()  # no-op when all finished; frees KV blocks if the client left

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        stats = ReplicaStats(
            replica_index=self.replica_index,
            address=self.address,
            healthy=self._driver is not None,
            pid=os.getpid(),
            prompts_received=self._received,
        )
        if self._driver is not None:
            engine = self._driver.stats()
            for name in (
                "running",
                "waiting",
                "free_blocks",
                "total_blocks",
                "requests_finished",
                "prompt_tokens",
                "generated_tokens",
                "preemptions",
            ):
                setattr(stats, name, getattr(engine, name))
        return pb.StatsReply(replicas=[convert.stats_to_proto(stats)])

    def Terminate(self, request: pb.TerminateRequest, context: grpc.ServicerContext) -> pb.TerminateReply:
        log.info("replica %d: terminate requested", self.replica_index)
        self.stop_requested.set()
        return pb.TerminateReply()

    # ---- helpers ----------------------------------------------------------------------------
    def _start(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> RpcRequests:
        """Validate, submit every prompt and tie their lifetime to the RPC's."""
        driver = self._driver
        if driver is None or self.stop_requested.is_set():
            abort_rpc(
                context, EngineDead(f"replica {self.replica_index} is not serving (loading or stopping)")
            )
        requests = RpcRequests(driver.submit, driver.abort)
        # why before submitting: a client that is already gone must not leave work behind
        if not context.add_callback(requests.abort_unfinished):
            abort_rpc(context, EngineDead("the RPC ended before it started"))
        try:
            requests.submit_all(request.prompts, convert.params_from_proto(request.params))
        except Exception as exc:  # noqa: BLE001 - typed errors keep their status, others become INTERNAL
            abort_rpc(context, exc)
        with self._lock:
            self._received += len(request.prompts)
        return requests
