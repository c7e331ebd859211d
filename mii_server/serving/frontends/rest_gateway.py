"""The REST gateway: MII's ``POST /mii/<deployment>`` over HTTP (Flask, served by waitress; no torch).

Body ``{"prompts": str | [str | [token ids], ...] | [token ids], "stream": bool, <generate kwargs>}``
(every ``GenerateParams`` kwarg: penalties, ``logit_bias``, ``logprobs``, ``prompt_logprobs``...).
Replies a JSON list of responses (``Response.to_msg_dict()``), or with ``"stream": true`` server-sent
events: one ``data: <chunk JSON with prompt_index>`` per chunk, then ``data: [DONE]``. Errors are JSON
``{"error": {"type", "code", "message"}}`` (``type`` the error class, ``code`` by ``http_common``'s
rule) with the status from ``status.http_status_of`` (400 for bad JSON, unknown kwargs and wrong
types; 413 for a body over ``max_request_body_bytes``, refused by waitress before it is read whole;
503 with ``Retry-After`` when overloaded). A streaming request waits for its first chunk before
answering, so a refusal gets its own status, not a 200 and an error event; a failure after the first
chunk is an ``event: error``. ``GET /healthz`` answers 200 while the process runs; ``GET /health`` 200
while a replica can serve (503 otherwise); ``GET /metrics`` is this gateway's HTTP series. API keys,
``X-Request-Id`` and CORS work as in the OpenAI server (``http_common``).

Concurrency: WSGI gives every in-flight request a thread, so waitress is sized from admission
(``GatewayRole.rest_threads``, from ``DeploymentConfig.rest_gateway_threads``): enough threads for every prompt the replicas would run
or queue, so the gateway never holds back a request a replica could take, and past that the
replicas refuse at once. The threads only wait: every upstream call runs on one shared event loop
(``LoopThread``), and a request whose client disconnects (waitress keeps reading the socket and
flags it) has its upstream call cancelled, which aborts its prompts on the replicas. One process's
Python work saturates one core, so the supervisor runs several on one port (``shared_port``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, current_app, g, request

from ...errors import DeploymentNotFound, InvalidRequest, MIIServerError
from ...generation.response import Response as GenerationResponse
from ...wire.prompts import prompt_list
from ...wire.types import Prompt, StreamChunk
from ..control.roles import GatewayRole
from ..metrics import HttpMetrics
from ..security import ApiKeys
from ..status import error_name_of, http_status_of
from .client import Client
from .http_common import (
    CLIENT_DISCONNECTED,
    CLIENT_GONE_STATUS,
    HEALTH_TIMEOUT_S,
    INVALID_API_KEY,
    NOT_FOUND,
    ORIGIN_NOT_ALLOWED,
    REQUEST_ID_HEADER,
    REQUEST_TOO_LARGE,
    SSE_DONE,
    SSE_HEADERS,
    CorsPolicy,
    HttpInstrumentation,
    InvalidJson,
    RequestScope,
    deployment_health,
    error_code,
    error_headers,
    sse_event,
    too_large_message,
    unreachable_health,
)
from .loop_thread import ClientGone, LoopThread
from .openai_logprobs import finite
from .shared_port import shared_port_sockets

log = logging.getLogger(__name__)

THREAD_STACK_BYTES = 512 * 1024  # a waiting request thread needs little stack; thousands of them are cheap
DRAIN_POLL_S = 0.05  # how often a stopping gateway checks whether its open requests are done


@dataclass
class RestGateway:
    """What every handler needs, kept in ``app.extensions["mii_server"]``."""

    deployment_name: str
    client: Client  # talks to the load balancer; shared by every request
    upstream: LoopThread  # where the client's calls run
    instrumentation: HttpInstrumentation
    cors: CorsPolicy


def _gateway() -> RestGateway:
    return current_app.extensions["mii_server"]


def error_body(exc: BaseException) -> dict[str, Any]:
    return _error_json(error_name_of(exc), error_code(exc), str(exc))


def _error_json(type_: str, code: str, message: str) -> dict[str, Any]:
    return {"error": {"type": type_, "code": code, "message": message}}


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def _error(exc: BaseException) -> Response:
    status = http_status_of(exc)
    if status >= 500:
        log.warning("request_id=%s failed: %s: %s", g.http.request_id, type(exc).__name__, exc)
    g.http.failure = error_code(exc)
    return _json(error_body(exc), status, error_headers(status))


def response_body(response: GenerationResponse) -> dict[str, Any]:
    """A response as JSON-ready data (log-probabilities below JSON's range sent as the floor, as the
    OpenAI server does)."""
    body = response.to_msg_dict()
    for entry in [*(body["logprobs"] or ()), *(body["prompt_logprobs"] or ())]:
        if entry is not None:
            entry["logprob"] = finite(entry["logprob"])
            for top in entry["top_logprobs"]:
                top["logprob"] = finite(top["logprob"])
    return body


def parse_body(raw: bytes) -> tuple[list[Prompt], bool, dict[str, Any]]:
    """(prompts, stream, generate kwargs) from a request body; ``InvalidRequest`` when malformed."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, or nested too deep to parse
        raise InvalidJson(f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidRequest('request body must be a JSON object like {"prompts": ["..."], "max_new_tokens": 32}')
    if "prompts" not in body:
        raise InvalidRequest('request body lacks "prompts" (a string or a list of strings)')
    kwargs = dict(body)
    prompts = prompt_list(kwargs.pop("prompts"), '"prompts"')
    stream = kwargs.pop("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest('"stream" must be true or false')
    return prompts, stream, kwargs


# ---- hooks ----------------------------------------------------------------------------------------


def _begin() -> Response | None:
    gw = _gateway()
    inst = gw.instrumentation
    g.http = inst.begin(request.method, request.path, request.headers.get(REQUEST_ID_HEADER))
    headers = {k.lower(): v for k, v in request.headers.items()}
    if gw.cors.enabled and CorsPolicy.is_preflight(request.method, headers):
        status, extra = gw.cors.preflight(headers)
        if status == 204:
            return Response(status=204, headers=extra)
        g.http.failure = ORIGIN_NOT_ALLOWED
        message = f"origin {headers.get('origin')!r:.200} is not in allowed_origins"
        return _json(_error_json("Forbidden", ORIGIN_NOT_ALLOWED, message), 403, extra)
    if not inst.authorized(g.http, request.headers.get("Authorization")):
        g.http.failure = INVALID_API_KEY
        body = _error_json("Unauthorized", INVALID_API_KEY, "missing or invalid API key (Authorization: Bearer)")
        return _json(body, 401, {"WWW-Authenticate": "Bearer"})
    return None


def _end(response: Response) -> Response:
    response.headers[REQUEST_ID_HEADER] = g.http.request_id
    for name, value in _gateway().cors.headers_for(request.headers.get("Origin")).items():
        response.headers[name] = value
    if not response.is_streamed:  # streams are counted when their generator ends
        _gateway().instrumentation.finish(g.http, _route(), response.status_code)
    return response


def _route() -> str:
    """The matched URL rule (bounded label values for metrics), not the raw path."""
    return request.url_rule.rule if request.url_rule is not None else "unmatched"


# ---- handlers -------------------------------------------------------------------------------------


def healthz() -> Response:
    """This process is up (the supervisor's readiness probe)."""
    return _json({"status": "ok"})


def health() -> Response:
    """The deployment can serve: a replica is loaded and routed to."""
    gw = _gateway()
    try:
        replicas = gw.upstream.run(gw.client.astats(timeout=HEALTH_TIMEOUT_S))
    except Exception as err:  # noqa: BLE001 - any failure to reach the load balancer is "unhealthy"
        return _json(unreachable_health(err), 503)
    ok, detail = deployment_health(replicas)
    return _json(detail, 200 if ok else 503)


def prometheus() -> Response:
    body, content_type = _gateway().instrumentation.metrics.exposition()
    return Response(body, content_type=content_type)


def generate(name: str) -> Response:
    gw = _gateway()
    gone = request.environ.get("waitress.client_disconnected", lambda: False)
    rid = g.http.request_id
    try:
        if name != gw.deployment_name:
            raise DeploymentNotFound(f"no deployment named {name!r} here (this gateway serves {gw.deployment_name!r})")
        prompts, stream, kwargs = parse_body(request.get_data())
        if not stream:
            responses = gw.upstream.call(gw.client.agenerate(prompts, request_id=rid, **kwargs), gone)
            return _json([response_body(r) for r in responses])
        batches = gw.upstream.iterate_batches(gw.client.agenerate_stream(prompts, request_id=rid, **kwargs), gone)
        first = next(batches, None)  # why wait: a refusal (too long, overloaded) gets its own status
    except ClientGone:
        g.http.failure = CLIENT_DISCONNECTED
        return _json({}, CLIENT_GONE_STATUS)  # nobody reads it; the instrumentation counts it
    except MIIServerError as exc:
        return _error(exc)
    return Response(
        _sse(first, batches, gw.instrumentation, g.http, _route()), mimetype="text/event-stream", headers=SSE_HEADERS
    )


def _sse(
    first: list[StreamChunk] | None,
    batches: Iterator[list[StreamChunk]],
    instrumentation: HttpInstrumentation,
    http: RequestScope,
    route: str,
) -> Iterator[str]:
    """Server-sent events: one per chunk, an ``error`` event if the stream fails, then [DONE]. Runs after
    the view returned, outside the request context: it uses only its arguments.

    The chunks that arrived together go out in one write (still one event each): under load, when
    this thread falls behind its stream, it catches up in fewer writes and thread wake-ups."""
    status = 200
    try:
        if first is not None:
            yield "".join(sse_event(response_body(chunk)) for chunk in first)
        for batch in batches:
            yield "".join(sse_event(response_body(chunk)) for chunk in batch)
    except ClientGone:
        status, http.failure = CLIENT_GONE_STATUS, CLIENT_DISCONNECTED
        return
    except GeneratorExit:  # waitress closed us: a write failed, the client is gone
        status, http.failure = CLIENT_GONE_STATUS, CLIENT_DISCONNECTED
        raise
    except MIIServerError as exc:
        http.failure = error_code(exc)
        yield sse_event(error_body(exc), event="error")
    finally:
        batches.close()  # cancels the upstream stream when it has not ended, aborting its prompts
        instrumentation.finish(http, route, status)
    yield SSE_DONE


def not_found(err: Any) -> Response:
    code = NOT_FOUND if err.code == 404 else "method_not_allowed"
    g.http.failure = code
    return _json(_error_json("NotFound", code, f"{request.method} {request.path}: {err.description}"), err.code)


def create_app(
    deployment_name: str,
    client: Client,
    upstream: LoopThread,
    keys: ApiKeys | None = None,
    metrics: HttpMetrics | None = None,
    allowed_origins: tuple[str, ...] | list[str] = (),
) -> Flask:
    """The Flask app; ``client``'s async calls run on ``upstream``. With ``keys``, every route but the
    open ones (``http_common.UNAUTHENTICATED``) needs ``Authorization: Bearer KEY``; ``allowed_origins``
    turns CORS on. The body limit is waitress's (``RestGatewayServer``)."""
    app = Flask("mii_server.rest_gateway")
    instrumentation = HttpInstrumentation(keys or ApiKeys([]), metrics)
    gateway = RestGateway(deployment_name, client, upstream, instrumentation, CorsPolicy(allowed_origins))
    app.extensions["mii_server"] = gateway
    app.before_request(_begin)
    app.after_request(_end)
    app.add_url_rule("/healthz", view_func=healthz, methods=["GET"])
    app.add_url_rule("/health", view_func=health, methods=["GET"])
    app.add_url_rule("/metrics", view_func=prometheus, methods=["GET"])
    app.add_url_rule("/mii/<name>", view_func=generate, methods=["POST"])
    app.register_error_handler(404, not_found)
    app.register_error_handler(405, not_found)
    return app


def _json_error_task() -> type:
    """waitress's error task (its replies to a body too large or malformed HTTP, before the app runs),
    answering with our JSON error body instead of plain text."""
    from waitress.task import ErrorTask

    class JsonErrorTask(ErrorTask):
        def execute(self) -> None:
            error = self.request.error
            code = REQUEST_TOO_LARGE if error.code == 413 else "invalid_request"
            limit = self.channel.adj.max_request_body_size - 1
            message = too_large_message(limit) if error.code == 413 else f"{error.reason}: {error.body}"
            body = json.dumps(_error_json(error.reason.replace(" ", ""), code, message)).encode()
            self.status = f"{error.code} {error.reason}"
            self.response_headers.append(("Content-Type", "application/json"))
            self.set_close_on_finish()
            self.content_length = len(body)
            self.write(body)

    return JsonErrorTask


def _json_error_channel() -> type:
    from waitress.channel import HTTPChannel

    class JsonErrorChannel(HTTPChannel):
        error_task_class = _json_error_task()

    return JsonErrorChannel


class RestGatewayServer:
    """The gateway on waitress, served from its own thread (``gateway.run_gateway`` drives it).

    Stopping: the listening socket closes at once (new connections are refused), the requests in
    progress (a stream included) finish and are flushed, idle keep-alive connections are closed,
    then the thread ends.
    """

    name = "REST gateway"

    def __init__(self, role: GatewayRole) -> None:
        """Bind the port now (``OSError`` when taken); serving starts with ``start()``."""
        import waitress  # why here: only this role needs it

        assert role.rest_port is not None
        threading.stack_size(THREAD_STACK_BYTES)  # before waitress starts its threads
        self._upstream = LoopThread()
        self._client = role.upstream_client()
        keys = ApiKeys.load(role.api_key_file)
        app = create_app(
            role.deployment_name, self._client, self._upstream, keys, allowed_origins=role.allowed_origins
        )
        self._map: dict[int, Any] = {}  # waitress's socket map: the listener, the trigger, the connections
        if role.rest_shared_port:  # one of several gateway processes on this port
            listen: dict[str, Any] = {"sockets": shared_port_sockets(role.host, role.rest_port)}
        else:
            listen = {"host": role.host, "port": role.rest_port}
        self._server = waitress.create_server(
            app,
            map=self._map,
            **listen,
            threads=role.rest_threads,
            connection_limit=role.rest_threads + 64,  # waitress's default (100) would cap concurrency below admission
            backlog=2048,
            ident="mii-server",
            channel_request_lookahead=1,  # keep reading the socket, so a client that leaves is seen at once
            max_request_body_size=role.max_request_body_bytes + 1,  # waitress refuses at >=: allow exactly the limit
        )
        self._server.channel_class = _json_error_channel()  # its own errors (413, malformed HTTP) as our JSON
        self._grace_s = role.stop_grace_s
        self._thread = threading.Thread(target=self._run, name="rest-gateway", daemon=True)
        log.info(
            "REST gateway on http://%s:%d/mii/%s with %d threads%s -> %s",
            role.host, role.rest_port, role.deployment_name, role.rest_threads,
            " (port shared with the other gateway processes)" if role.rest_shared_port else "", role.load_balancer,
        )  # fmt: skip

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._server.run()  # returns once the socket map is empty (``stop``)
        finally:
            self._server.task_dispatcher.shutdown()

    def _busy(self) -> bool:
        """A connection has a request in progress or bytes not yet sent."""
        from waitress.channel import HTTPChannel

        return any(
            isinstance(c, HTTPChannel) and (c.requests or c.total_outbufs_len) for c in list(self._map.values())
        )

    def stop(self, forced: threading.Event) -> None:
        """Stop listening, let open requests finish (within the role's ``stop_grace_s``, None: no
        limit; until ``forced``), close every connection, and return once the server thread has ended."""
        from waitress import wasyncore

        if not self._thread.is_alive():  # it died on its own: nothing to drain
            self._close_upstream()
            return
        # why thunks: the socket map belongs to the server thread; the trigger runs them there
        self._server.trigger.pull_trigger(lambda: wasyncore.dispatcher.close(self._server))
        deadline = None if self._grace_s is None else time.monotonic() + self._grace_s
        while self._busy() and (deadline is None or time.monotonic() < deadline):
            if forced.wait(DRAIN_POLL_S):
                break
        self._server.trigger.pull_trigger(lambda: wasyncore.close_all(self._map))
        self._thread.join()
        self._close_upstream()

    def _close_upstream(self) -> None:
        self._upstream.run(self._client.aclose(), timeout=5)
        self._upstream.close()
