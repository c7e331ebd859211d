"""The replica's gRPC servicer (rank 0, ``grpc.aio``): every RPC's prompts go to one shared ``EngineDriver``.

Concurrent RPCs from any number of clients land in the same continuous batch. No RPC holds a thread:
each is a task on the event loop that awaits its prompts' updates, which the batching thread hands
over through the ``UpdateRelay`` (one wake-up per engine step). Tokenisation and chat templates run
on a small thread pool, off the event loop and off the batching loop. A prompt is text or token ids;
ids are checked against the vocabulary before anything is queued. The caller's request id is logged
only when it is a safe token (``convert.request_id_of``), so a gRPC caller cannot forge log lines. An RPC that ends early
(cancelled by its caller, deadline, the load balancer giving up) aborts its unfinished prompts in its
``finally``, which frees their KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from ..batching.request import Request, RequestUpdate
from ..errors import CapacityExceeded, EngineDead, InvalidRequest
from ..generation.params import GenerateParams
from ..serving.metrics import ReplicaMetrics
from ..serving.multiplexed import Emit, serve_multiplexed
from ..serving.status import RemoteError, abort_rpc
from ..wire import convert, generation_pb2_grpc
from ..wire import generation_pb2 as pb
from ..wire.types import EngineStats, Prompt, ReplicaStats
from . import tokenizer_service
from .chat import render_chat
from .relay import UpdateRelay
from .rpc_requests import Forward, RpcRequests

if TYPE_CHECKING:
    from .engine_driver import EngineDriver

log = logging.getLogger(__name__)

PREPARE_THREADS = 4  # tokenisation and chat templates, off the event loop
DEMO_MODEL_ID = "mii-server-demo"  # the served id of the built-in demo model (DeploymentConfig.served_model)


class ReplicaServicer(generation_pb2_grpc.GenerationServicer):
    """Serves Generate/GenerateStream/Stats/Terminate/ApplyChatTemplate/Tokenize/TokenizerInfo over an engine
    driver attached once
    loaded. Admission: a request whose prompts would make more than ``max_queued_requests`` prompts wait
    for the engine is refused at once with ``CapacityExceeded`` (RESOURCE_EXHAUSTED; HTTP 503 with
    ``Retry-After`` at the front ends)."""

    def __init__(
        self, replica_index: int, address: str, max_queued_requests: int | None = None, model_name: str = ""
    ) -> None:
        """``model_name``: the served model id (metrics label, stats); empty: the model's path, known at
        ``attach`` (the deployment's default served id)."""
        self.replica_index = replica_index
        self.address = address
        self.max_queued_requests = max_queued_requests  # None: unbounded
        self.stop_requested = asyncio.Event()  # set on the loop by Terminate or a signal
        self.model_name = model_name
        self.metrics = ReplicaMetrics(replica_index, model_name=model_name)
        self._driver: EngineDriver | None = None
        self._relay: UpdateRelay | None = None
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self._received = 0  # prompts accepted since this process started
        self._outstanding = 0  # prompts admitted and not finished (preparing, waiting or running)

    def attach(self, driver: EngineDriver, relay: UpdateRelay) -> None:
        """Start taking requests (called on the event loop once the model has loaded)."""
        self.model_name = self.model_name or driver.config.model_name_or_path or DEMO_MODEL_ID
        self.metrics.model_name = self.model_name
        self._driver = driver
        self._relay = relay

    def close(self) -> None:
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    def health(self) -> tuple[bool, dict[str, object]]:
        """(serving, detail) for the HTTP ``/health`` beside ``/metrics`` (any thread)."""
        driver = self._driver
        ok = driver is not None and driver.alive and not self.stop_requested.is_set()
        state = "serving" if ok else ("loading" if driver is None else "stopping")
        return ok, {"status": "ok" if ok else "unavailable", "replica": self.replica_index, "state": state}

    def engine_stats(self) -> list[ReplicaStats]:
        """This replica's counters as a one-entry list (empty while loading), for the metrics collector."""
        return [self._stats()] if self._driver is not None else []

    # ---- RPCs -------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateReply:
        requests = await self._start(request, context, stream=False)
        try:
            responses = await requests.results()
        except Exception as exc:  # noqa: BLE001 - a prompt failed: the whole RPC fails with its status
            await abort_rpc(context, exc)
        finally:
            requests.abort_unfinished()  # no-op when all finished; frees KV blocks if the caller left
        return pb.GenerateReply(completions=[convert.completion_to_proto(r, i) for i, r in enumerate(responses)])

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Completion]:
        requests = await self._start(request, context, stream=True)
        try:
            async for index, update in requests.updates():
                if update.error is not None:
                    await abort_rpc(context, update.error)
                yield convert.completion_to_proto(update.response, index)
        finally:
            requests.abort_unfinished()

    async def GenerateMultiplexed(
        self, request_iterator: AsyncIterator[pb.MultiplexedRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """GenerateStream's requests from a load balancer over one call (``serving.multiplexed``)."""
        await serve_multiplexed(self._multiplexed_stream, request_iterator, context)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        return pb.StatsReply(replicas=[convert.stats_to_proto(self._stats())])

    async def ApplyChatTemplate(
        self, request: pb.ChatTemplateRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChatTemplateReply:
        driver = await self._serving_driver(context)
        try:
            messages = convert.chat_messages_from_proto(request)
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(self._prepare_pool, render_chat, driver.tokenizer(), messages)
        except InvalidRequest as exc:
            await abort_rpc(context, exc)
        return convert.chat_reply_to_proto(prompt)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeReply:
        driver = await self._serving_driver(context)
        try:
            prompts = convert.prompts_from_proto(request.prompts)
            results = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool,
                lambda: tokenizer_service.tokenize(
                    driver.tokenizer(),
                    prompts,
                    _vocabulary(driver),
                    add_special_tokens=request.add_special_tokens,
                    token_strings=request.token_strings,
                ),
            )
        except InvalidRequest as exc:
            await abort_rpc(context, exc)
        return convert.tokenized_to_proto(results)

    async def TokenizerInfo(
        self, request: pb.TokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizerInfoReply:
        driver = await self._serving_driver(context)
        info = tokenizer_service.describe(driver.tokenizer(), driver.context_length, _vocabulary(driver))
        return convert.tokenizer_info_to_proto(info)

    async def Terminate(
        self, request: pb.TerminateRequest, context: grpc.aio.ServicerContext
    ) -> pb.TerminateReply:
        log.info("replica %d: terminate requested", self.replica_index)
        self.stop_requested.set()
        return pb.TerminateReply()

    # ---- helpers ----------------------------------------------------------------------------
    def _stats(self) -> ReplicaStats:
        engine = self._driver.stats() if self._driver is not None else EngineStats()
        return ReplicaStats(
            **vars(engine),
            replica_index=self.replica_index,
            address=self.address,
            healthy=self.health()[0],  # loaded, its batching loop alive, not stopping
            pid=os.getpid(),
            prompts_received=self._received,
            busy_step_s=self._driver.busy_step_s if self._driver is not None else 0.0,
            model_name=self.model_name,
        )

    def _live_driver(self) -> EngineDriver:
        """The engine driver; ``EngineDead`` while loading or stopping."""
        driver = self._driver
        if driver is None or self.stop_requested.is_set():
            raise EngineDead(f"replica {self.replica_index} is not serving (loading or stopping)")
        return driver

    async def _serving_driver(self, context: grpc.aio.ServicerContext) -> EngineDriver:
        try:
            return self._live_driver()
        except EngineDead as exc:
            await abort_rpc(context, exc)

    async def _start(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, stream: bool
    ) -> RpcRequests:
        """``_open``, ending the RPC with the status of any refusal."""
        try:
            return await self._open(request, stream)
        except Exception as exc:  # noqa: BLE001 - typed errors keep their status, others become INTERNAL
            await abort_rpc(context, exc)

    async def _open(
        self, request: pb.GenerateRequest, stream: bool, forward: Forward | None = None
    ) -> RpcRequests:
        """Admit, prepare every prompt (off the loop) and enqueue them together; the caller owns the
        returned requests and must ``abort_unfinished`` them when its RPC ends. ``stream``: the caller
        reads text as it comes (else the text is decoded once, when each prompt finishes); ``forward``:
        see ``RpcRequests``. Raises the refusal (not serving, a bad request, overloaded)."""
        driver = self._live_driver()
        request_id = convert.request_id_of(request)
        count = len(request.prompts)
        try:
            prompts = convert.prompts_from_proto(request.prompts)
            params = convert.params_from_proto(request.params)
            self._admit(driver, count)
        except Exception as exc:
            self._rejected(request_id, exc)
            raise
        self._outstanding += count  # why now: concurrent admissions must see these prompts
        timings = [self.metrics.start() for _ in range(count)]
        requests = RpcRequests(
            count,
            stream=stream,
            relay=self._relay,
            abort=driver.abort,
            observe=lambda i, update: self.metrics.observe(timings[i], update),
            on_final=lambda i, update: self._finished(request_id, update),
            forward=forward,
        )
        try:
            loop = asyncio.get_running_loop()
            prepared = await loop.run_in_executor(
                self._prepare_pool, _prepare_all, driver, prompts, params, requests, stream
            )
            driver.enqueue(prepared)
        except BaseException as exc:  # a bad prompt, a dead engine, or the caller left while we prepared
            self._outstanding -= count
            if isinstance(exc, Exception):
                self._rejected(request_id, exc)
            raise
        for i, req in enumerate(prepared):
            requests.bind(i, req.uid)
        self._received += count
        log.info("request_id=%s accepted prompts=%d", request_id, count)
        return requests

    async def _multiplexed_stream(self, request: pb.GenerateRequest, emit: Emit) -> None:
        """One stream of GenerateMultiplexed: as GenerateStream, but each update goes to ``emit`` as
        the event loop gets it, with no task per stream woken per token."""
        failure: list[BaseException] = []

        def forward(index: int, update: RequestUpdate) -> None:
            if update.error is not None:
                failure.append(update.error)
            elif not failure:
                emit(convert.completion_to_proto(update.response, index))

        try:
            requests = await self._open(request, stream=True, forward=forward)
        except Exception as exc:  # noqa: BLE001 - the stream's status, as _start's abort would give it
            raise RemoteError.of(exc) from None
        try:
            await requests.settled()
        finally:
            requests.abort_unfinished()  # no-op when all finished; frees KV blocks if cancelled
        if failure:
            raise RemoteError.of(failure[0])

    def _rejected(self, request_id: str, exc: Exception) -> None:
        self.metrics.failed(exc)
        log.info("request_id=%s rejected: %s: %s", request_id, type(exc).__name__, exc)

    def _admit(self, driver: EngineDriver, num_prompts: int) -> None:
        """Raise ``CapacityExceeded`` when ``num_prompts`` more would make more than
        ``max_queued_requests`` prompts wait on this replica."""
        if self.max_queued_requests is None:
            return
        waiting = max(0, self._outstanding - driver.stats().running)
        if waiting + num_prompts > self.max_queued_requests:
            raise CapacityExceeded(
                f"replica {self.replica_index} is overloaded: {waiting} prompts are waiting and this request "
                f"brings {num_prompts} (max_queued_requests={self.max_queued_requests}); retry later"
            )

    def _finished(self, request_id: str, update: RequestUpdate) -> None:
        """A prompt's final update reached the loop: count it and log its end."""
        self._outstanding -= 1
        r = update.response
        log.info(
            "request_id=%s uid=%s finished reason=%s prompt_tokens=%s generated_tokens=%s",
            request_id,
            update.uid,
            type(update.error).__name__ if update.error is not None else r.finish_reason.value,
            r.prompt_length if r is not None else "-",
            r.generated_length if r is not None else "-",
        )


def _vocabulary(driver: EngineDriver) -> int:
    return tokenizer_service.vocabulary_size(driver.tokenizer(), driver.loop.vocab_size)


def _prepare_all(
    driver: EngineDriver, prompts: list[Prompt], params: GenerateParams, requests: RpcRequests, stream: bool
) -> list[Request]:
    """Check the token ids, tokenise and validate every prompt of an RPC before any is queued (a bad one
    leaves nothing behind)."""
    tokenizer_service.check_token_ids(prompts, _vocabulary(driver))
    return driver.prepare_many(prompts, params, [requests.sink(i) for i in range(len(prompts))], stream)
