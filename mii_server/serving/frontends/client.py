"""``Client``: talks to a deployment's load balancer over gRPC (sync, streaming and asyncio).

Imports neither torch nor the engine. Generate kwargs are validated here first (``UnknownArgument``
/ ``InvalidRequest`` before any network traffic) and again by the replica. A failed RPC raises the
typed error the server raised, with its message (``status.error_from_rpc``).

A load balancer that dies is restarted by the supervisor within a second or two. A call that could not
reach it, or lost it before any output arrived (``status.is_transport_failure``), is sent again once
it answers, for up to ``BALANCER_RETURN_WAIT_S`` (and the call's timeout): the replica dropped the
lost copy with the connection, so nothing runs twice. Output already streamed is never repeated:
such a stream ends with ``ReplicaUnavailable``.

Streaming yields ``StreamChunk`` objects: ``Response`` deltas whose ``prompt_index`` names the prompt
(chunks of different prompts interleave; each prompt's last chunk has ``finish_reason != NONE``).

A prompt is text or a list of token ids (checked against the vocabulary by the replica):
``generate("text")``, ``generate(["a", "b"])``, ``generate([1, 2, 3])`` (one prompt of ids) and
``generate([[1, 2], [3]])`` (two) all work.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from ...errors import InvalidRequest, MIIServerError, ReplicaUnavailable
from ...generation.params import GenerateParams
from ...generation.response import Response
from ...wire import convert, generation_pb2_grpc
from ...wire import generation_pb2 as pb
from ...wire.prompts import Prompts, prompt_list
from ...wire.types import Prompt, ReplicaStats, StreamChunk, Tokenized, TokenizerInfo
from .. import grpc_common
from ..control import registry
from ..security import ApiKeys, call_metadata, trusting
from ..status import error_from_rpc, is_transport_failure

TERMINATE_WAIT_S = 120.0
BALANCER_RETURN_WAIT_S = 10.0  # how long a call waits for a load balancer it lost (see the docstring)


class _Reconnect:
    """One call's budget for waiting on a lost load balancer: ``BALANCER_RETURN_WAIT_S`` from its first
    transport failure, and no more than the call's timeout."""

    def __init__(self, timeout: float | None) -> None:
        self._limit = BALANCER_RETURN_WAIT_S if timeout is None else min(BALANCER_RETURN_WAIT_S, timeout)
        self._deadline: float | None = None

    def seconds_left(self, err: grpc.RpcError, address: str, output_seen: bool = False) -> float:
        """How long to wait for the balancer before sending the call again; raises the call's typed error
        when it is not sent again (its output would be repeated, no transport failure, no time left)."""
        if output_seen or not is_transport_failure(err):
            raise error_from_rpc(err, address) from None
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self._limit
        if now >= self._deadline:
            raise self.error(err, address) from None
        return self._deadline - now

    def error(self, err: grpc.RpcError, address: str) -> MIIServerError:
        """The typed error of a transport failure that outlasted the wait, saying how long it waited."""
        error = error_from_rpc(err, address)
        return ReplicaUnavailable(f"{error} (waited {self._limit:g} s for it to answer)") if self._limit else error


class Client:
    """A connection to one deployment (its load balancer at ``address``, ``host:port``)."""

    def __init__(
        self,
        address: str,
        *,
        deployment_name: str = "",
        timeout: float | None = None,
        supervisor: subprocess.Popen | None = None,
        supervisor_pid: int | None = None,
        api_key: str | None = None,
        admin_token: str = "",
        tls_ca_file: str = "",
    ) -> None:
        """``api_key``: presented on every call when the deployment requires one (None: the first key
        of ``$MII_SERVER_API_KEY``); ``admin_token``: what ``terminate_server`` presents (``client(name)``
        reads it from the owner-only registry record); ``tls_ca_file``: trust this CA and speak TLS."""
        self.address = address
        self.deployment_name = deployment_name
        self.timeout = timeout  # seconds per RPC; None waits as long as generation takes
        self._supervisor = supervisor  # set by serve(): the process to reap on terminate
        self._supervisor_pid_hint = supervisor_pid  # set by client(name), from the registry record
        self._api_key = ApiKeys.load().first if api_key is None else api_key
        self._admin_token = admin_token
        self._credentials = trusting(tls_ca_file)
        self._channel = grpc_common.channel(address, self._api_key, self._credentials)
        self._sync_stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._closed = False
        self._aio: (
            tuple[asyncio.AbstractEventLoop, grpc.aio.Channel, generation_pb2_grpc.GenerationStub] | None
        ) = None

    def _check_open(self) -> None:
        # why: grpcio crashes the process (SIGSEGV) on a call over a closed synchronous channel
        if self._closed:
            raise InvalidRequest(f"this client of {self.address} is closed; make a new one")

    @property
    def _stub(self) -> generation_pb2_grpc.GenerationStub:
        self._check_open()
        return self._sync_stub

    def __repr__(self) -> str:
        return f"Client({self.address!r}, deployment_name={self.deployment_name!r})"

    # ---- sync -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompts,
        *,
        streaming_fn: Callable[[list[Response]], None] | None = None,
        request_id: str = "",
        **generate_kwargs: Any,
    ) -> list[Response]:
        """One ``Response`` per prompt, in order, once all are finished.

        ``streaming_fn`` (MII's callback streaming): called with ``[chunk]`` for every ``StreamChunk``
        as it arrives (any number of prompts, unlike MII); the whole responses are still returned.
        ``request_id`` (optional) names the request in every process's logs.
        """
        if streaming_fn is not None:
            chunks: dict[int, list[Response]] = {}
            for chunk in self.generate_stream(prompts, request_id=request_id, **generate_kwargs):
                streaming_fn([chunk])
                chunks.setdefault(chunk.prompt_index, []).append(chunk)
            return [Response.join(chunks[i]) for i in sorted(chunks)]
        prompts_, request = self._request(prompts, generate_kwargs, request_id)
        if not prompts_:
            return []
        reply = self._call("Generate", request, self.timeout)
        return convert.reply_from_proto(reply, len(prompts_))

    __call__ = generate  # MII's client is callable too

    def generate_stream(
        self, prompts: Prompts, *, request_id: str = "", **generate_kwargs: Any
    ) -> Iterator[StreamChunk]:
        """Incremental chunks for every prompt as they are produced (see the module docstring).

        Kwargs are validated now; breaking out of the loop cancels the request on the server.
        """
        prompts_, request = self._request(prompts, generate_kwargs, request_id)
        return self._stream(request) if prompts_ else iter(())

    def _stream(self, request: pb.GenerateRequest) -> Iterator[StreamChunk]:
        reconnect = _Reconnect(self.timeout)
        while True:
            call = self._stub.GenerateStream(request, timeout=self.timeout)
            started = False
            try:
                for msg in call:
                    started = True
                    yield convert.chunk_from_proto(msg)
                return
            except grpc.RpcError as err:
                if not self._balancer_back(reconnect.seconds_left(err, self.address, started)):
                    raise reconnect.error(err, self.address) from None
            finally:
                call.cancel()  # no-op after a clean end

    def apply_chat_template(self, messages: list[tuple[str, str]], *, request_id: str = "") -> str:
        """The prompt the model's chat template makes of (role, content) ``messages`` (rendered by a replica).

        ``InvalidRequest`` when the model has no chat template.
        """
        request = convert.chat_request_to_proto(messages, add_generation_prompt=True, request_id=request_id)
        reply = self._call("ApplyChatTemplate", request, self.timeout)
        return convert.chat_prompt_from_proto(reply)

    def tokenize(
        self,
        prompts: Prompts,
        *,
        add_special_tokens: bool = True,
        token_strings: bool = False,
        request_id: str = "",
    ) -> list[Tokenized]:
        """Each prompt through the model's tokenizer (on a replica): text is encoded (with the special
        tokens the tokenizer adds, such as BOS, unless ``add_special_tokens=False``), token ids are
        checked against the vocabulary and decoded. ``token_strings``: also each token decoded alone."""
        request = self._tokenize_request(prompts, add_special_tokens, token_strings, request_id)
        reply = self._call("Tokenize", request, self.timeout)
        return convert.tokenized_from_proto(reply)

    def tokenizer_info(self) -> TokenizerInfo:
        """The tokenizer's special tokens and chat template, the vocabulary size and the context length."""
        reply = self._call("TokenizerInfo", pb.TokenizerInfoRequest(), self.timeout)
        return convert.tokenizer_info_from_proto(reply)

    def stats(self, timeout: float = 30.0) -> list[ReplicaStats]:
        """Counters of every replica (down ones have ``healthy=False``)."""
        reply = self._call("Stats", pb.StatsRequest(), timeout, reconnect=False)
        return [convert.stats_from_proto(r) for r in reply.replicas]

    def terminate_server(self, wait: bool = True) -> None:
        """Stop every process of the deployment; with ``wait``, return once they are gone."""
        pid = self._supervisor_pid()

        def running() -> bool:  # why asked: a stopped deployment's balancer is not waited for, and is no error
            return pid is None or registry.pid_alive(pid)

        try:
            metadata = call_metadata(admin_token=self._admin_token)
            self._call("Terminate", pb.TerminateRequest(), 60.0, reconnect=running(), metadata=metadata)
        except ReplicaUnavailable:
            if running():
                raise
        if wait:
            self._wait_until_gone(pid)
        self.close()

    def _supervisor_pid(self) -> int | None:
        if self._supervisor is not None:
            return self._supervisor.pid
        if self._supervisor_pid_hint is not None:
            return self._supervisor_pid_hint
        for record in registry.list_records():
            if record.address == self.address and (
                not self.deployment_name or record.name == self.deployment_name
            ):
                return record.supervisor_pid
        return None

    def _wait_until_gone(self, pid: int | None) -> None:
        deadline = time.monotonic() + TERMINATE_WAIT_S
        if self._supervisor is not None:
            try:
                self._supervisor.wait(timeout=TERMINATE_WAIT_S)  # also reaps it: no zombie
            except subprocess.TimeoutExpired:
                raise ReplicaUnavailable(
                    f"deployment at {self.address} did not stop within {TERMINATE_WAIT_S}s"
                )
            return
        while time.monotonic() < deadline:
            if pid is not None and not registry.pid_alive(pid):
                return
            if pid is None and not grpc_common.is_serving(self._channel, timeout=0.5):
                return
            time.sleep(0.05)  # polling a condition, bounded by the deadline
        raise ReplicaUnavailable(f"deployment at {self.address} did not stop within {TERMINATE_WAIT_S}s")

    def close(self) -> None:
        self._closed = True
        self._channel.close()
        self._aio = None  # an aio channel is closed by its own loop's shutdown (or by aclose)

    async def aclose(self) -> None:
        """Close both channels, from the event loop that used the async methods."""
        if self._aio is not None:
            await self._aio[1].close()
        self.close()

    def __enter__(self) -> Client:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- asyncio ----------------------------------------------------------------------------
    async def agenerate(
        self, prompts: Prompts, *, request_id: str = "", **generate_kwargs: Any
    ) -> list[Response]:
        """Async twin of ``generate``; cancelling the awaiting task cancels the request on the server."""
        prompts_, request = self._request(prompts, generate_kwargs, request_id)
        if not prompts_:
            return []
        reply = await self._acall("Generate", request, self.timeout)
        return convert.reply_from_proto(reply, len(prompts_))

    def agenerate_stream(
        self, prompts: Prompts, *, request_id: str = "", **generate_kwargs: Any
    ) -> AsyncIterator[StreamChunk]:
        """Async twin of ``generate_stream`` (``async for chunk in client.agenerate_stream(...)``)."""
        prompts_, request = self._request(prompts, generate_kwargs, request_id)
        return self._astream(request, bool(prompts_))

    async def _astream(self, request: pb.GenerateRequest, any_prompt: bool) -> AsyncIterator[StreamChunk]:
        if not any_prompt:
            return
        reconnect = _Reconnect(self.timeout)
        while True:
            call = self._aio_stub().GenerateStream(request, timeout=self.timeout)
            started = False
            try:
                async for msg in call:
                    started = True
                    yield convert.chunk_from_proto(msg)
                return
            except grpc.RpcError as err:
                if not await self._abalancer_back(reconnect.seconds_left(err, self.address, started)):
                    raise reconnect.error(err, self.address) from None
            finally:
                call.cancel()

    def astream(
        self, prompts: list[Prompt], params: GenerateParams, *, request_id: str = ""
    ) -> AsyncIterator[StreamChunk]:
        """Stream with already validated ``params`` (what the HTTP front ends call). Closing the iterator,
        or cancelling the task that reads it, cancels the call, which aborts its prompts on the replicas."""
        return self._astream(convert.request_to_proto(prompt_list(prompts), params, request_id), bool(prompts))

    async def aapply_chat_template(self, messages: list[tuple[str, str]], *, request_id: str = "") -> str:
        """Async twin of ``apply_chat_template``."""
        request = convert.chat_request_to_proto(messages, add_generation_prompt=True, request_id=request_id)
        reply = await self._acall("ApplyChatTemplate", request, self.timeout)
        return convert.chat_prompt_from_proto(reply)

    async def atokenize(
        self,
        prompts: Prompts,
        *,
        add_special_tokens: bool = True,
        token_strings: bool = False,
        request_id: str = "",
    ) -> list[Tokenized]:
        """Async twin of ``tokenize``."""
        request = self._tokenize_request(prompts, add_special_tokens, token_strings, request_id)
        reply = await self._acall("Tokenize", request, self.timeout)
        return convert.tokenized_from_proto(reply)

    async def atokenizer_info(self) -> TokenizerInfo:
        """Async twin of ``tokenizer_info``."""
        reply = await self._acall("TokenizerInfo", pb.TokenizerInfoRequest(), self.timeout)
        return convert.tokenizer_info_from_proto(reply)

    async def astats(self, timeout: float = 30.0) -> list[ReplicaStats]:
        """Async twin of ``stats``."""
        reply = await self._acall("Stats", pb.StatsRequest(), timeout, reconnect=False)
        return [convert.stats_from_proto(r) for r in reply.replicas]

    def _aio_stub(self) -> generation_pb2_grpc.GenerationStub:
        # why per loop: a grpc.aio channel belongs to the event loop that created it
        self._check_open()
        loop = asyncio.get_running_loop()
        if self._aio is None or self._aio[0] is not loop:
            channel = grpc_common.aio_channel(self.address, self._api_key, self._credentials)
            self._aio = (loop, channel, generation_pb2_grpc.GenerationStub(channel))
        return self._aio[2]

    # ---- helpers ----------------------------------------------------------------------------
    def _call(
        self, method: str, request: Any, timeout: float | None, reconnect: bool = True,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> Any:  # fmt: skip
        """One unary RPC, sent again once a lost load balancer answers (``reconnect``); a failure raised
        as the typed error it stands for."""
        waiting = _Reconnect(timeout if reconnect else 0.0)
        while True:
            try:
                return getattr(self._stub, method)(request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as err:
                if not self._balancer_back(waiting.seconds_left(err, self.address)):
                    raise waiting.error(err, self.address) from None

    async def _acall(self, method: str, request: Any, timeout: float | None, reconnect: bool = True) -> Any:
        """Async twin of ``_call``, on this event loop's channel."""
        waiting = _Reconnect(timeout if reconnect else 0.0)
        while True:
            try:
                return await getattr(self._aio_stub(), method)(request, timeout=timeout)
            except grpc.RpcError as err:
                if not await self._abalancer_back(waiting.seconds_left(err, self.address)):
                    raise waiting.error(err, self.address) from None

    def _balancer_back(self, seconds: float) -> bool:
        """Whether the channel to the load balancer is ready again within ``seconds``."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=seconds)
            return True
        except grpc.FutureTimeoutError:
            ready.cancel()  # why: unsubscribes it from the channel's state changes
            return False

    async def _abalancer_back(self, seconds: float) -> bool:
        """Async twin of ``_balancer_back``, on this event loop's channel."""
        assert self._aio is not None  # the failed attempt made this loop's channel
        try:
            await asyncio.wait_for(self._aio[1].channel_ready(), seconds)
            return True
        except asyncio.TimeoutError:
            return False

    def _request(
        self, prompts: Prompts, kwargs: dict[str, Any], request_id: str = ""
    ) -> tuple[list[Prompt], pb.GenerateRequest]:
        prompts_ = prompt_list(prompts)
        params = GenerateParams.from_kwargs(**kwargs)
        return prompts_, convert.request_to_proto(prompts_, params, request_id)

    @staticmethod
    def _tokenize_request(
        prompts: Prompts, add_special_tokens: bool, token_strings: bool, request_id: str
    ) -> pb.TokenizeRequest:
        return convert.tokenize_request_to_proto(
            prompt_list(prompts), add_special_tokens=add_special_tokens, token_strings=token_strings, request_id=request_id
        )
