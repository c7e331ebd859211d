"""The replica's gRPC servicer (rank 0): every RPC's prompts go to one shared ``EngineDriver``.

Concurrent RPCs from any number of clients land in the same continuous batch, because the driver
batches everything submitted from any thread. A cancelled RPC (client gone, deadline, load
balancer cancelling) aborts its unfinished prompts, which frees their KV blocks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc

from ..errors import CapacityExceeded, EngineDead, InvalidRequest
from ..serving.metrics import ReplicaMetrics
from ..serving.status import abort_rpc
from ..wire import convert, generation_pb2_grpc
from ..wire import generation_pb2 as pb
from ..wire.types import EngineStats, ReplicaStats
from .rpc_requests import RpcRequests

if TYPE_CHECKING:
    from .engine_driver import EngineDriver, RequestUpdate

log = logging.getLogger(__name__)


class ReplicaServicer(generation_pb2_grpc.GenerationServicer):
    """Serves Generate/GenerateStream/Stats/Terminate/ApplyChatTemplate over an engine driver attached once
    loaded. With ``max_queued_requests``, a request arriving while that many prompts wait is refused with
    ``CapacityExceeded`` (RESOURCE_EXHAUSTED; HTTP 503 at the gateways)."""

    def __init__(self, replica_index: int, address: str, max_queued_requests: int | None = None) -> None:
        self.replica_index = replica_index
        self.address = address
        self.max_queued_requests = max_queued_requests  # None: unbounded
        self.stop_requested = threading.Event()
        self.metrics = ReplicaMetrics(replica_index)
        self._driver: EngineDriver | None = None
        self._lock = threading.Lock()
        self._received = 0  # prompts accepted since this process started
        self._outstanding = 0  # prompts submitted and not finished (running, waiting or queued)

    def attach(self, driver: EngineDriver) -> None:
        """Start taking requests (called once the model has loaded)."""
        self._driver = driver

    def health(self) -> tuple[bool, dict[str, object]]:
        """(serving, detail) for the HTTP ``/health`` beside ``/metrics``."""
        driver = self._driver
        ok = driver is not None and driver.alive and not self.stop_requested.is_set()
        state = "serving" if ok else ("loading" if driver is None else "stopping")
        return ok, {"status": "ok" if ok else "unavailable", "replica": self.replica_index, "state": state}

    def engine_stats(self) -> list[ReplicaStats]:
        """This replica's counters as a one-entry list (empty while loading), for the metrics collector."""
        return [self._stats()] if self._driver is not None else []

    # ---- RPCs -------------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateReply:
        requests = self._start(request, context, stream=False)
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
        requests = self._start(request, context, stream=True)
        try:
            for index, update in requests.updates():
                if update.error is not None:
                    requests.abort_unfinished()
                    abort_rpc(context, update.error)
                yield convert.completion_to_proto(update.response, index)
        finally:
            requests.abort_unfinished()  # no-op when all finished; frees KV blocks if the client left

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        return pb.StatsReply(replicas=[convert.stats_to_proto(self._stats())])

    def ApplyChatTemplate(
        self, request: pb.ChatTemplateRequest, context: grpc.ServicerContext
    ) -> pb.ChatTemplateReply:
        driver = self._driver
        if driver is None or self.stop_requested.is_set():
            abort_rpc(
                context, EngineDead(f"replica {self.replica_index} is not serving (loading or stopping)")
            )
        try:
            prompt = render_chat(driver.tokenizer(), convert.chat_messages_from_proto(request))
        except InvalidRequest as exc:
            abort_rpc(context, exc)
        return convert.chat_reply_to_proto(prompt)

    def _stats(self) -> ReplicaStats:
        engine = self._driver.stats() if self._driver is not None else EngineStats()
        return ReplicaStats(
            **vars(engine),
            replica_index=self.replica_index,
            address=self.address,
            healthy=self._driver is not None,
            pid=os.getpid(),
            prompts_received=self._received,
        )

    def Terminate(self, request: pb.TerminateRequest, context: grpc.ServicerContext) -> pb.TerminateReply:
        log.info("replica %d: terminate requested", self.replica_index)
        self.stop_requested.set()
        return pb.TerminateReply()

    # ---- helpers ----------------------------------------------------------------------------
    def _start(self, request: pb.GenerateRequest, context: grpc.ServicerContext, stream: bool) -> RpcRequests:
        """Validate, submit every prompt and tie their lifetime to the RPC's. ``stream``: the caller
        reads text as it comes (else the text is decoded once, when each prompt finishes)."""
        driver = self._driver
        if driver is None or self.stop_requested.is_set():
            abort_rpc(
                context, EngineDead(f"replica {self.replica_index} is not serving (loading or stopping)")
            )
        try:
            self._admit(driver, len(request.prompts))
        except CapacityExceeded as exc:
            self.metrics.failed(exc)
            log.warning("request_id=%s rejected: %s", request.request_id or "-", exc)
            abort_rpc(context, exc)
        requests = RpcRequests(self._instrumented_submit(driver, request.request_id, stream), driver.abort)
        # why before submitting: a client that is already gone must not leave work behind
        if not context.add_callback(requests.abort_unfinished):
            abort_rpc(context, EngineDead("the RPC ended before it started"))
        try:
            requests.submit_all(request.prompts, convert.params_from_proto(request.params))
        except Exception as exc:  # noqa: BLE001 - typed errors keep their status, others become INTERNAL
            self.metrics.failed(exc)
            log.info("request_id=%s rejected: %s: %s", request.request_id or "-", type(exc).__name__, exc)
            abort_rpc(context, exc)
        with self._lock:
            self._received += len(request.prompts)
        log.info("request_id=%s accepted prompts=%d", request.request_id or "-", len(request.prompts))
        return requests

    def _admit(self, driver: EngineDriver, num_prompts: int) -> None:
        """Raise ``CapacityExceeded`` when ``max_queued_requests`` prompts already wait on this replica."""
        if self.max_queued_requests is None:
            return
        with self._lock:
            outstanding = self._outstanding
        waiting = max(0, outstanding - driver.stats().running)
        if waiting >= self.max_queued_requests:
            raise CapacityExceeded(
                f"replica {self.replica_index} is overloaded: {waiting} requests are waiting "
                f"(max_queued_requests={self.max_queued_requests}); retry later"
            )

    def _instrumented_submit(self, driver: EngineDriver, request_id: str, stream: bool) -> Callable[..., int]:
        """``driver.submit`` that counts outstanding prompts, feeds metrics and logs each prompt's end."""

        def submit(prompt: str, params: object, sink: Callable[[object], None]) -> int:
            timing = self.metrics.start()
            holder: dict[str, int] = {}

            def observing(update: RequestUpdate) -> None:
                self.metrics.observe(timing, update)
                if update.finished:
                    with self._lock:
                        self._outstanding -= 1
                    r = update.response
                    log.info(
                        "request_id=%s uid=%s finished reason=%s prompt_tokens=%s generated_tokens=%s",
                        request_id or "-",
                        holder.get("uid", "?"),
                        type(update.error).__name__ if update.error is not None else r.finish_reason.value,
                        r.prompt_length if r is not None else "-",
                        r.generated_length if r is not None else "-",
                    )
                sink(update)

            with self._lock:
                self._outstanding += 1
            try:
                uid = driver.submit(prompt, params, observing, stream=stream)
            except BaseException as exc:
                with self._lock:
                    self._outstanding -= 1
                self.metrics.failed(exc)
                raise
            holder["uid"] = uid
            return uid

        return submit


def render_chat(tokenizer: object, messages: list[dict[str, str]]) -> str:
    """The prompt text of ``messages`` under the tokenizer's chat template (``InvalidRequest`` if none).

    A leading BOS the template writes is dropped when the tokenizer adds BOS itself on encode, so the
    prompt is not tokenised with two.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "this model has no chat template, so /v1/chat/completions cannot format messages; "
            "use /v1/completions with a prompt"
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template that rejects the messages (e.g. role order)
        raise InvalidRequest(f"the chat template cannot render these messages: {err}") from None
    bos = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos and text.startswith(bos) and bos_id is not None and bos_id in tokenizer.encode(""):
        text = text[len(bos) :]
    return text
