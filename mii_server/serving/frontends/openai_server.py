"""The OpenAI-compatible server: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` over gRPC.

An ASGI app (FastAPI on uvicorn, as MII's and vLLM's OpenAI servers are); no torch. Every request is
a task on one event loop, and every upstream call an awaitable on the same loop, so thousands of open
streams cost no thread each. Chat messages are rendered by a replica (``ApplyChatTemplate`` RPC: the
replica holds the real tokenizer, so templates behave exactly as in ``transformers``), and usage is
counted from the replicas' own prompt and output token counts. A request becomes one or more
``GenerateStream`` calls to the load balancer (``openai_protocol.Plan.sub_requests``), merged into one
queue.

Disconnects: a non-streaming request races its upstream calls against the ASGI ``http.disconnect``
message; a streaming one is cancelled by Starlette when the client leaves. Either way the upstream
calls are cancelled, the cancellation travels through the load balancer to the replicas, and they
abort the prompts and free their KV blocks.

Routes other than ``/health`` and ``/healthz`` need ``Authorization: Bearer KEY`` once a key is set;
every reply carries ``X-Request-Id`` (``http_common.HttpInstrumentation``, shared with the REST gateway).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...errors import MIIServerError
from ...wire.types import StreamChunk
from ..control.roles import GatewayRole
from ..metrics import EngineStatsCollector, HttpMetrics, exposition
from .client import Client
from .http_common import (
    CLIENT_GONE_STATUS,
    HEALTH_TIMEOUT_S,
    REQUEST_ID_HEADER,
    SSE_DONE,
    SSE_HEADERS,
    ApiKeys,
    HttpInstrumentation,
    RequestScope,
    deployment_health,
    error_headers,
    sse_event,
    unreachable_health,
)
from .openai_protocol import (
    ApiError,
    Plan,
    ResponseBuilder,
    api_error_of,
    bad_request,
    model_body,
    models_body,
    parse,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client closed its connection."""


@dataclass
class OpenAIServer:
    """What every handler needs, kept on ``app.state.server``."""

    client: Client  # talks to the load balancer; shared by every request
    model: str  # the served model id
    created: int  # the model's "created" timestamp
    instrumentation: HttpInstrumentation


def _server(request: Request) -> OpenAIServer:
    return request.app.state.server


def _scope(request: Request) -> RequestScope:
    return request.scope["state"]["http"]


def _error_response(err: ApiError, scope: RequestScope) -> JSONResponse:
    scope.failure = err.reason
    headers = error_headers(err.status)
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(err.body(), err.status, headers=headers)


class Instrumented:
    """ASGI middleware: request id, API key, access log and HTTP metrics around every request (streams
    are counted when their last byte is out, or when their client leaves)."""

    def __init__(self, app: ASGIApp, instrumentation: HttpInstrumentation) -> None:
        self.app = app
        self.instrumentation = instrumentation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        inst = self.instrumentation
        http = inst.begin(scope["method"], scope["path"], headers.get(REQUEST_ID_HEADER.lower()))
        scope.setdefault("state", {})["http"] = http
        status = CLIENT_GONE_STATUS  # until a response starts

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", http.request_id.encode())]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                inst.finish(http, _route_of(scope), status)

        try:
            if not inst.authorized(http, headers.get("authorization")):
                err = ApiError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                               "authentication_error", None, "invalid_api_key")  # fmt: skip
                await _error_response(err, http)(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        except Exception:
            http.failure = http.failure or "internal_error"
            inst.finish(http, _route_of(scope), 500)
            raise
        finally:
            if not http.finished:  # the response never completed: the client left first
                http.failure = http.failure or "client_disconnected"
                inst.finish(http, _route_of(scope), CLIENT_GONE_STATUS)


def _route_of(scope: Scope) -> str:
    """The matched route (bounded label values for metrics), not the raw path."""
    route = scope.get("route")
    return getattr(route, "path", "unmatched")


# ---- handlers -------------------------------------------------------------------------------------


async def healthz(request: Request) -> JSONResponse:
    """This process is up (the supervisor's readiness probe)."""
    return JSONResponse({"status": "ok"})


async def health(request: Request) -> JSONResponse:
    """The deployment can serve: at least one replica is loaded and routed to."""
    try:
        replicas = await _server(request).client.astats(timeout=HEALTH_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - any failure to reach the load balancer is "unhealthy"
        return JSONResponse(unreachable_health(err), 503)
    ok, detail = deployment_health(replicas)
    return JSONResponse(detail, 200 if ok else 503)


async def prometheus(request: Request) -> Response:
    registry = _server(request).instrumentation.metrics.registry
    # why a thread: the engine collector reads the replicas' stats with a blocking call
    body, content_type = await asyncio.get_running_loop().run_in_executor(None, exposition, registry)
    return Response(body, media_type=content_type)


async def list_models(request: Request) -> JSONResponse:
    server = _server(request)
    return JSONResponse(models_body(server.model, server.created))


async def get_model(request: Request, name: str) -> JSONResponse:
    server = _server(request)
    if name != server.model:
        err = ApiError(404, f"The model `{name}` does not exist.", "not_found_error", "model", "model_not_found")
        return _error_response(err, _scope(request))
    return JSONResponse(model_body(server.model, server.created))


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    server = _server(request)
    request_id = _scope(request).request_id
    upstream: Upstream | None = None
    try:
        plan = parse(await _json_body(request), chat=chat, served_model=server.model)
        if chat:
            rendered = server.client.aapply_chat_template(plan.messages, request_id=request_id)
            plan.prompts = [await _unless_gone(request, rendered)]
        upstream = Upstream(server.client, plan, request_id)
        events = upstream.events()
        # why wait for the first chunk: an error before any output still gets its own status
        first = await _unless_gone(request, anext(events, None))
        builder = ResponseBuilder(plan, request_id)
        if plan.stream:
            return StreamingResponse(
                _sse(request, plan, builder, first, events, upstream), media_type="text/event-stream", headers=SSE_HEADERS
            )
        if first is not None:
            builder.add(*first)
        await _unless_gone(request, _collect(builder, events))
        upstream.close()
        return JSONResponse(builder.whole())
    except ClientGone:
        if upstream is not None:
            upstream.close()
        _scope(request).failure = "client_disconnected"
        return JSONResponse({}, CLIENT_GONE_STATUS)  # nobody reads it; the instrumentation counts it
    except (ApiError, MIIServerError) as exc:
        if upstream is not None:
            upstream.close()
        return _error_response(api_error_of(exc), _scope(request))


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, or nested too deep to parse
        raise bad_request("the request body is not valid JSON") from None


async def _collect(builder: ResponseBuilder, events: AsyncIterator[tuple[int, StreamChunk]]) -> None:
    async for choice, chunk in events:
        builder.add(choice, chunk)


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first (then ``ClientGone``; ``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed its connection (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(
    request: Request,
    plan: Plan,
    builder: ResponseBuilder,
    first: tuple[int, StreamChunk] | None,
    events: AsyncIterator[tuple[int, StreamChunk]],
    upstream: Upstream,
) -> AsyncIterator[str]:
    """The event stream; Starlette cancels it when the client leaves (then ``finally`` cancels upstream)."""
    try:
        if first is not None:
            builder.add(*first)
            for body in builder.chunk(*first):
                yield sse_event(body)
        async for choice, chunk in events:
            builder.add(choice, chunk)
            for body in builder.chunk(choice, chunk):
                yield sse_event(body)
        if plan.include_usage:
            yield sse_event(builder.usage_chunk())
    except (ApiError, MIIServerError) as exc:  # headers are sent: the error becomes the next event
        err = api_error_of(exc)
        _scope(request).failure = err.reason
        yield sse_event(err.body())
    finally:
        upstream.close()  # no-op once every stream ended; aborts the prompts otherwise
    yield SSE_DONE


class Upstream:
    """The upstream streams of one HTTP request, merged into one queue of (choice index, chunk) events.

    One task per stream; ``close()`` cancels them all. ``events()`` yields until every stream has
    ended, raising the first upstream error.
    """

    def __init__(self, client: Client, plan: Plan, request_id: str) -> None:
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        subs = plan.sub_requests()
        self._tasks = [
            asyncio.ensure_future(self._pump(client.astream(s.prompts, s.params, request_id=request_id), s.choice_indices))
            for s in subs
        ]
        self._active = len(self._tasks)

    async def _pump(self, stream: AsyncIterator[StreamChunk], choices: list[int]) -> None:
        try:
            async for chunk in stream:
                self._queue.put_nowait(("chunk", (choices[chunk.prompt_index], chunk)))
        except Exception as exc:  # noqa: BLE001 - handed to the handler, which maps it
            self._queue.put_nowait(("error", exc))
            return
        self._queue.put_nowait(("done", None))

    async def events(self) -> AsyncIterator[tuple[int, StreamChunk]]:
        while self._active:
            kind, payload = await self._queue.get()
            if kind == "chunk":
                yield payload
            elif kind == "done":
                self._active -= 1
            else:
                raise payload

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code in (404, 405) else "invalid_request_error"
    err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)
    return _error_response(err, _scope(request))


def create_app(served_model: str, client: Client, keys: ApiKeys, metrics: HttpMetrics | None = None) -> FastAPI:
    """The ASGI app for model id ``served_model``; ``client`` talks to the load balancer and is shared
    by every request."""
    app = FastAPI(title="mii-server OpenAI-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
    instrumentation = HttpInstrumentation(keys, metrics)
    instrumentation.metrics.registry.register(EngineStatsCollector(lambda: client.stats(timeout=HEALTH_TIMEOUT_S)))
    app.state.server = OpenAIServer(client, served_model, int(time.time()), instrumentation)
    app.add_middleware(Instrumented, instrumentation=instrumentation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", get_model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app


class OpenAIServerThread:
    """The OpenAI server on uvicorn, on its own thread and event loop (``gateway.run_gateway`` drives it).

    Stopping: uvicorn closes its listening socket, closes idle connections, lets the requests in
    progress (streams included) finish, then the thread ends.
    """

    name = "OpenAI server"

    def __init__(self, role: GatewayRole) -> None:
        import uvicorn  # why here: only this role needs it

        assert role.openai_port is not None
        keys = ApiKeys.load(role.api_key_file)
        self._client = Client(role.load_balancer, deployment_name=role.deployment_name)
        self._server = uvicorn.Server(
            uvicorn.Config(
                create_app(role.served_model, self._client, keys),
                host=role.host,
                port=role.openai_port,
                loop="asyncio",  # why not uvloop: grpc.aio shares this loop
                lifespan="off",
                log_config=None,
                access_log=False,  # the instrumentation writes one line per request, with its id
                backlog=4096,
                timeout_graceful_shutdown=role.stop_grace_s,
            )
        )
        self._thread = threading.Thread(target=self._run, name="openai-server", daemon=True)
        log.info(
            "OpenAI-compatible server on http://%s:%d/v1 (model %r, %s) -> %s",
            role.host, role.openai_port, role.served_model,
            "API key required" if keys.required else "no API key", role.load_balancer,
        )  # fmt: skip

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            await self._server.serve()  # off the main thread, uvicorn leaves the signals to us
        finally:
            await self._client.aclose()

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, forced: threading.Event) -> None:
        """Ask uvicorn to stop (it drains within the role's ``stop_grace_s``; cut at ``forced``) and
        return once the server thread has ended."""
        self._server.should_exit = True
        while self._thread.is_alive():
            if forced.wait(0.1):
                self._server.force_exit = True
            self._thread.join(0.1)
