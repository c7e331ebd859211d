"""The OpenAI-compatible server: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` over gRPC,
with vLLM's ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and ``/version``.

An ASGI app (FastAPI on uvicorn, as MII's and vLLM's OpenAI servers are); no torch. Every request is
a task on one event loop, and every upstream call an awaitable on the same loop, so thousands of open
streams cost no thread each. Chat messages are rendered by a replica (``ApplyChatTemplate`` RPC: the
replica holds the real tokenizer, so templates behave exactly as in ``transformers``), and usage is
counted from the replicas' own prompt and output token counts. A request becomes one or more
``GenerateStream`` calls to the load balancer (``openai_protocol.Plan.sub_requests``), merged into one
queue. A non-streaming request whose replica dies after it produced output (the load balancer retries
only calls that produced none) is sent again, up to ``RETRIES`` times: its caller has seen nothing.

Disconnects: a non-streaming request races its upstream calls against the ASGI ``http.disconnect``
message; a streaming one is cancelled by Starlette when the client leaves. Either way the upstream
calls are cancelled, the cancellation travels through the load balancer to the replicas, and they
abort the prompts and free their KV blocks.

Routes other than ``/health``, ``/healthz``, ``/metrics`` and ``/version`` need ``Authorization: Bearer
KEY`` once a key is set; every reply carries ``X-Request-Id`` (``http_common.HttpInstrumentation``,
shared with the REST gateway). A request body larger than ``max_request_body_bytes`` is refused with
413 before it is read whole (its ``Content-Length``, or as it streams in). CORS is opt-in
(``allowed_origins``, ``http_common.CorsPolicy``).
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

from ...errors import EngineDead, MIIServerError, ReplicaUnavailable
from ...wire.types import StreamChunk, TokenizerInfo
from ..control.roles import GatewayRole
from ..metrics import HttpMetrics
from ..security import ApiKeys
from .client import Client
from .http_common import (
    CLIENT_DISCONNECTED,
    CLIENT_GONE_STATUS,
    HEALTH_TIMEOUT_S,
    INTERNAL_ERROR,
    INVALID_API_KEY,
    INVALID_JSON,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    ORIGIN_NOT_ALLOWED,
    REQUEST_ID_HEADER,
    REQUEST_TOO_LARGE,
    SSE_DONE,
    SSE_HEADERS,
    CorsPolicy,
    HttpInstrumentation,
    RequestScope,
    deployment_health,
    error_headers,
    server_version,
    sse_event,
    too_large_message,
    unreachable_health,
)
from .openai_protocol import (
    ApiError,
    Plan,
    ResponseBuilder,
    SubRequest,
    api_error_of,
    bad_request,
    model_body,
    model_not_found,
    models_body,
    parse,
)
from .shared_port import shared_port_sockets
from .tokenizer_endpoints import (
    detokenize_body,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
    tokenizer_info_body,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRIES = 2  # times a non-streaming request is sent again after its replica died mid-generation
DEFAULT_MAX_BODY_BYTES = 32 * 2**20


class ClientGone(Exception):
    """The HTTP client closed its connection."""


@dataclass
class OpenAIServer:
    """What every handler needs, kept on ``app.state.server``."""

    client: Client  # talks to the load balancer; shared by every request
    model: str  # the served model id
    created: int  # the model's "created" timestamp
    instrumentation: HttpInstrumentation
    max_body_bytes: int  # larger request bodies are refused with 413
    tokenizer_info: TokenizerInfo | None = None  # asked of a replica once, then kept (the model is fixed)

    async def info(self) -> TokenizerInfo:
        if self.tokenizer_info is None:
            self.tokenizer_info = await self.client.atokenizer_info()
        return self.tokenizer_info


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
    """ASGI middleware: request id, CORS, API key, access log and HTTP metrics around every request
    (streams are counted when their last byte is out, or when their client leaves)."""

    def __init__(self, app: ASGIApp, instrumentation: HttpInstrumentation, cors: CorsPolicy) -> None:
        self.app = app
        self.instrumentation = instrumentation
        self.cors = cors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        inst = self.instrumentation
        http = inst.begin(scope["method"], scope["path"], headers.get(REQUEST_ID_HEADER.lower()))
        scope.setdefault("state", {})["http"] = http
        status = CLIENT_GONE_STATUS  # until a response starts
        extra = [(b"x-request-id", http.request_id.encode())]
        extra += [(k.lower().encode(), v.encode()) for k, v in self.cors.headers_for(headers.get("origin")).items()]

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                inst.finish(http, _route_of(scope), status)

        try:
            if self.cors.enabled and CorsPolicy.is_preflight(scope["method"], headers):
                await _preflight(self.cors, headers, http)(scope, receive, send_with_id)
                return
            if not inst.authorized(http, headers.get("authorization")):
                err = ApiError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                               "authentication_error", None, INVALID_API_KEY)  # fmt: skip
                await _error_response(err, http)(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        except Exception:
            http.failure = http.failure or INTERNAL_ERROR
            inst.finish(http, _route_of(scope), 500)
            raise
        finally:
            if not http.finished:  # the response never completed: the client left first
                http.failure = http.failure or CLIENT_DISCONNECTED
                inst.finish(http, _route_of(scope), CLIENT_GONE_STATUS)


def _preflight(cors: CorsPolicy, headers: dict[str, str], scope: RequestScope) -> Response:
    """The reply to a CORS preflight: 204 with the allowed methods and headers, or 403."""
    status, extra = cors.preflight(headers)
    if status == 204:
        return Response(status_code=204, headers=extra)
    err = ApiError(403, f"origin {headers.get('origin')!r:.200} is not in allowed_origins", "invalid_request_error",
                   None, ORIGIN_NOT_ALLOWED)  # fmt: skip
    response = _error_response(err, scope)
    response.headers.update(extra)
    return response


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
    """This front end's own HTTP series (the engine's are each replica's, on its own /metrics)."""
    body, content_type = _server(request).instrumentation.metrics.exposition()
    return Response(body, media_type=content_type)


async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": server_version()})


async def list_models(request: Request) -> JSONResponse:
    server = _server(request)
    return JSONResponse(models_body(server.model, server.created))


async def get_model(request: Request, name: str) -> JSONResponse:
    """Any id ``/v1/models`` lists, a local path with slashes included (the SDK sends them %2F-encoded;
    the path is decoded before routing, and the leading slash of ``/tmp/m`` survives as ``//tmp/m``)."""
    server = _server(request)
    if name != server.model:
        return _error_response(model_not_found(name), _scope(request))
    return JSONResponse(model_body(server.model, server.created))


async def tokenize(request: Request) -> Response:
    server = _server(request)
    rid = _scope(request).request_id
    try:
        req = parse_tokenize(await _json_body(request))
        if req.model is not None and req.model != server.model:
            raise model_not_found(req.model)
        prompt = req.prompt
        pairs = req.message_pairs
        if pairs is not None:
            prompt = await _unless_gone(request, server.client.aapply_chat_template(pairs, request_id=rid))
        call = server.client.atokenize(
            [prompt], add_special_tokens=req.special_tokens, token_strings=req.return_token_strs, request_id=rid
        )
        (result,) = await _unless_gone(request, call)
        info = await _unless_gone(request, server.info())
    except ClientGone:
        return _gone(request)
    except (ApiError, MIIServerError) as exc:
        return _error_response(api_error_of(exc), _scope(request))
    return JSONResponse(tokenize_body(result, info.max_model_len, req.return_token_strs))


async def detokenize(request: Request) -> Response:
    server = _server(request)
    try:
        req = parse_detokenize(await _json_body(request))
        if req.model is not None and req.model != server.model:
            raise model_not_found(req.model)
        call = server.client.atokenize([req.tokens], request_id=_scope(request).request_id)
        (result,) = await _unless_gone(request, call)
    except ClientGone:
        return _gone(request)
    except (ApiError, MIIServerError) as exc:
        return _error_response(api_error_of(exc), _scope(request))
    return JSONResponse(detokenize_body(result))


async def tokenizer_info(request: Request) -> Response:
    try:
        info = await _unless_gone(request, _server(request).info())
    except ClientGone:
        return _gone(request)
    except MIIServerError as exc:
        return _error_response(api_error_of(exc), _scope(request))
    return JSONResponse(tokenizer_info_body(info))


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
        if plan.needs_tokenized_prompts:  # echo: the prompts' text and first tokens, from a replica
            tokenized = server.client.atokenize(
                plan.prompts, token_strings=plan.logprobs is not None, request_id=request_id
            )
            plan.tokenized = await _unless_gone(request, tokenized)
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
        return _gone(request)
    except (ApiError, MIIServerError) as exc:
        if upstream is not None:
            upstream.close()
        return _error_response(api_error_of(exc), _scope(request))


def _gone(request: Request) -> JSONResponse:
    _scope(request).failure = CLIENT_DISCONNECTED
    return JSONResponse({}, CLIENT_GONE_STATUS)  # nobody reads it; the instrumentation counts it


async def _json_body(request: Request) -> Any:
    """The body as JSON, read in pieces up to the server's limit (413 past it, before it is read whole)."""
    limit = _server(request).max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, too_large_message(limit), "invalid_request_error", None, REQUEST_TOO_LARGE)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:  # a chunked body, or one longer than it said
            raise ApiError(413, too_large_message(limit), "invalid_request_error", None, REQUEST_TOO_LARGE)
        parts.append(part)
    try:
        return json.loads(b"".join(parts))
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, or nested too deep to parse
        raise bad_request("the request body is not valid JSON", code=INVALID_JSON) from None


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
            for body in builder.chunk(*first):
                yield sse_event(body)
        async for choice, chunk in events:
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
    ended, raising the first upstream error. For a non-streaming request each stream's chunks are held
    until it ends, so a stream whose replica died after producing output can be run again whole.
    """

    def __init__(self, client: Client, plan: Plan, request_id: str) -> None:
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._client = client
        self._request_id = request_id
        self._tasks = [asyncio.ensure_future(self._pump(s, whole=not plan.stream)) for s in plan.sub_requests()]
        self._active = len(self._tasks)

    async def _pump(self, sub: SubRequest, whole: bool) -> None:
        for attempt in range(RETRIES + 1):
            held: list[tuple[int, StreamChunk]] = []
            try:
                async for chunk in self._client.astream(sub.prompts, sub.params, request_id=self._request_id):
                    event = (sub.choice_indices[chunk.prompt_index], chunk)
                    if whole:
                        held.append(event)
                    else:
                        self._queue.put_nowait(("chunk", event))
            except (ReplicaUnavailable, EngineDead) as exc:
                # why only after output: before any, the load balancer has retried and waited already
                if whole and held and attempt < RETRIES:
                    log.warning("request_id=%s: a replica died mid-generation (%s); sending the request again",
                                self._request_id, exc)  # fmt: skip
                    continue
                self._queue.put_nowait(("error", exc))
                return
            except Exception as exc:  # noqa: BLE001 - handed to the handler, which maps it
                self._queue.put_nowait(("error", exc))
                return
            for event in held:
                self._queue.put_nowait(("chunk", event))
            self._queue.put_nowait(("done", None))
            return

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
    code = {404: NOT_FOUND, 405: METHOD_NOT_ALLOWED}.get(exc.status_code, "invalid_request")
    err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind, None, code)
    return _error_response(err, _scope(request))


def create_app(
    served_model: str,
    client: Client,
    keys: ApiKeys,
    metrics: HttpMetrics | None = None,
    *,
    allowed_origins: tuple[str, ...] | list[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The ASGI app for model id ``served_model``; ``client`` talks to the load balancer and is shared
    by every request. ``allowed_origins``: CORS (none: off); ``max_body_bytes``: larger bodies are 413."""
    app = FastAPI(title="mii-server OpenAI-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
    instrumentation = HttpInstrumentation(keys, metrics)
    app.state.server = OpenAIServer(client, served_model, int(time.time()), instrumentation, max_body_bytes)
    app.add_middleware(Instrumented, instrumentation=instrumentation, cors=CorsPolicy(allowed_origins))
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
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
        self._client = role.upstream_client()
        self._server = uvicorn.Server(
            uvicorn.Config(
                create_app(
                    role.served_model,
                    self._client,
                    keys,
                    allowed_origins=role.allowed_origins,
                    max_body_bytes=role.max_request_body_bytes,
                ),
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
        # one of several server processes on this port: bound here, with SO_REUSEPORT
        self._sockets = shared_port_sockets(role.host, role.openai_port) if role.openai_shared_port else None
        self._thread = threading.Thread(target=self._run, name="openai-server", daemon=True)
        log.info(
            "OpenAI-compatible server on http://%s:%d/v1%s (model %r, %s) -> %s",
            role.host, role.openai_port, " (port shared with the other server processes)" if self._sockets else "",
            role.served_model, "API key required" if keys.required else "no API key", role.load_balancer,
        )  # fmt: skip

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            await self._server.serve(self._sockets)  # off the main thread, uvicorn leaves the signals to us
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
