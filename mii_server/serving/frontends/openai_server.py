"""The OpenAI-compatible server: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` over gRPC.

Flask on waitress, like the REST gateway; no torch. Chat messages are rendered by a replica
(``ApplyChatTemplate`` RPC: the replica holds the real tokenizer, so templates behave exactly as in
``transformers`` and this process loads nothing), and usage is counted from the replicas' own prompt
and output token counts. Every request becomes one or more ``GenerateStream`` calls to the load
balancer (see ``openai_protocol.Plan.sub_requests``), pumped into one queue.

Disconnects: waitress runs with ``channel_request_lookahead=1``, so it keeps reading the socket while a
request runs and notices a closed connection at once (``environ["waitress.client_disconnected"]``).
While waiting for upstream chunks the handler polls that flag; when the client is gone, or waitress
closes the response iterator, the upstream calls are cancelled, and the cancellation travels through
the load balancer to the replicas, which abort the prompts and free their KV blocks.

Routes other than ``/health`` and ``/healthz`` need ``Authorization: Bearer KEY`` once a key is set
(``http_common.ApiKeys``). Every reply carries ``X-Request-Id`` (the caller's or a fresh one), and the
id travels to the replicas' logs in ``GenerateRequest.request_id``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from flask import Flask, Response, g, request

from ...errors import MIIServerError
from ...wire.types import StreamChunk
from ..control.deployment import DeploymentConfig
from ..metrics import EngineStatsCollector, HttpMetrics, exposition
from .client import Client, StreamCall
from .http_common import REQUEST_ID_HEADER, ApiKeys, deployment_health, request_id_from, serve_wsgi
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

POLL_S = 0.1  # how often a waiting handler checks whether its client is still connected
RETRY_AFTER_S = 1
UNAUTHENTICATED = {"/health", "/healthz"}


class ClientGone(Exception):
    """The HTTP client closed its connection."""


class Upstream:
    """The upstream streams of one HTTP request, merged into one queue of (choice index, chunk) events.

    One pump thread per stream; ``cancel()`` (any thread) cancels them all. ``events()`` yields until
    every stream has ended, raising the first upstream error, or ``ClientGone`` when ``gone()`` says so.
    """

    def __init__(self, calls: list[tuple[StreamCall, list[int]]], gone: Callable[[], bool]) -> None:
        self._calls = calls
        self._gone = gone
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._active = len(calls)
        for call, choices in calls:
            threading.Thread(target=self._pump, args=(call, choices), daemon=True).start()

    def _pump(self, call: StreamCall, choices: list[int]) -> None:
        try:
            for chunk in call:
                self._queue.put(("chunk", (choices[chunk.prompt_index], chunk)))
        except Exception as exc:  # noqa: BLE001 - handed to the HTTP thread, which maps it
            self._queue.put(("error", exc))
            return
        self._queue.put(("done", None))

    def events(self) -> Iterator[tuple[int, StreamChunk]]:
        while self._active:
            try:
                kind, payload = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._gone():
                    raise ClientGone() from None
                continue
            if kind == "chunk":
                yield payload
            elif kind == "done":
                self._active -= 1
            else:
                raise payload

    def cancel(self) -> None:
        for call, _ in self._calls:
            call.cancel()


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json", headers=headers)


def _error_response(err: ApiError) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else {}
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return _json(err.body(), err.status, headers)


def create_app(
    config: DeploymentConfig, client: Client, keys: ApiKeys, metrics: HttpMetrics | None = None
) -> Flask:
    """The Flask app; ``client`` talks to the load balancer and is shared by every request."""
    app = Flask("mii_server.openai_server")
    model = config.served_model
    created = int(time.time())
    metrics = metrics or HttpMetrics()
    metrics.registry.register(EngineStatsCollector(lambda: client.stats(timeout=2.0)))

    @app.before_request
    def _begin() -> Response | None:
        g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        g.started = time.monotonic()
        g.observed = False
        if request.path not in UNAUTHENTICATED and not keys.allows(request.headers.get("Authorization")):
            return _error_response(
                ApiError(
                    401,
                    "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                    "authentication_error",
                    None,
                    "invalid_api_key",
                )
            )
        return None

    @app.after_request
    def _end(response: Response) -> Response:
        response.headers[REQUEST_ID_HEADER] = g.request_id
        if not response.is_streamed and not g.observed:
            _observe(_route(), response.status_code, _reason_of(response))
        return response

    def _observe(route: str, status: int, reason: str = "") -> None:
        g.observed = True
        seconds = time.monotonic() - g.started
        metrics.finished(route, status, seconds, reason)
        log.info(
            "request_id=%s method=%s path=%s status=%d duration_s=%.3f%s",
            g.request_id,
            request.method,
            route,
            status,
            seconds,
            f" error={reason}" if reason else "",
        )

    @app.get("/healthz")
    def healthz() -> Response:  # this process is up (the supervisor's readiness probe)
        return _json({"status": "ok"})

    @app.get("/health")
    def health() -> Response:  # the deployment can serve: at least one replica is loaded and routed to
        ok, detail = deployment_health(client)
        return _json(detail, 200 if ok else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        body, content_type = exposition(metrics.registry)
        return Response(body, content_type=content_type)

    @app.get("/v1/models")
    def list_models() -> Response:
        return _json(models_body(model, created))

    @app.get("/v1/models/<path:name>")
    def get_model(name: str) -> Response:
        if name != model:
            return _error_response(
                ApiError(
                    404, f"The model `{name}` does not exist.", "not_found_error", "model", "model_not_found"
                )
            )
        return _json(model_body(model, created))

    @app.post("/v1/completions")
    def completions() -> Response:
        return _generate(chat=False)

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        return _generate(chat=True)

    def _generate(chat: bool) -> Response:
        gone = request.environ.get("waitress.client_disconnected", lambda: False)
        try:
            body = request.get_json(force=True, silent=True)
            if body is None:
                raise bad_request("the request body is not valid JSON")
            plan = parse(body, chat=chat, served_model=model)
            if chat:
                plan.prompts = [client.apply_chat_template(plan.messages, request_id=g.request_id)]
            upstream = _start(plan, gone)
        except (ApiError, MIIServerError) as exc:
            return _error_response(api_error_of(exc))
        builder = ResponseBuilder(plan, g.request_id)
        events = upstream.events()
        try:
            first = next(events, None)  # why wait: an error before any output still gets its own status
        except ClientGone:
            upstream.cancel()
            _observe(_route(), 499, "client_disconnected")
            return _json({}, 499)
        except Exception as exc:  # noqa: BLE001 - upstream errors keep their type (status map)
            upstream.cancel()
            return _error_response(api_error_of(exc))
        if plan.stream:
            return Response(
                _sse(plan, builder, first, events, upstream, _route(), g.request_id, g.started),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            if first is not None:
                builder.add(*first)
            for choice, chunk in events:
                builder.add(choice, chunk)
        except ClientGone:
            upstream.cancel()
            _observe(_route(), 499, "client_disconnected")
            return _json({}, 499)
        except Exception as exc:  # noqa: BLE001
            upstream.cancel()
            return _error_response(api_error_of(exc))
        return _json(builder.whole())

    def _start(plan: Plan, gone: Callable[[], bool]) -> Upstream:
        calls: list[tuple[StreamCall, list[int]]] = []
        try:
            for sub in plan.sub_requests():
                calls.append(
                    (client.open_stream(sub.prompts, sub.params, request_id=g.request_id), sub.choice_indices)
                )
        except BaseException:
            for call, _ in calls:
                call.cancel()
            raise
        return Upstream(calls, gone)

    def _sse(
        plan: Plan,
        builder: ResponseBuilder,
        first: tuple[int, StreamChunk] | None,
        events: Iterator[tuple[int, StreamChunk]],
        upstream: Upstream,
        route: str,
        request_id: str,
        started: float,
    ) -> Iterator[str]:
        # runs after the view returned, outside the request context: it uses only its arguments
        status, reason = 200, ""
        try:
            pending = [first] if first is not None else []
            while True:
                for choice, chunk in pending:
                    builder.add(choice, chunk)
                    for body in builder.chunk(choice, chunk):
                        yield f"data: {json.dumps(body)}\n\n"
                item = next(events, None)
                if item is None:
                    break
                pending = [item]
            if plan.include_usage:
                yield f"data: {json.dumps(builder.usage_chunk())}\n\n"
        except ClientGone:
            status, reason = 499, "client_disconnected"
            return
        except GeneratorExit:  # waitress closed us: the client is gone
            status, reason = 499, "client_disconnected"
            raise
        except Exception as exc:  # noqa: BLE001 - headers are sent: the error becomes the next event
            err = api_error_of(exc)
            status, reason = err.status, err.reason
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            upstream.cancel()  # no-op once every stream ended; aborts the prompts otherwise
            seconds = time.monotonic() - started
            metrics.finished(route, status, seconds, reason)
            log.info(
                "request_id=%s stream path=%s status=%d duration_s=%.3f%s",
                request_id,
                route,
                status,
                seconds,
                f" error={reason}" if reason else "",
            )
        yield "data: [DONE]\n\n"

    @app.errorhandler(404)
    @app.errorhandler(405)
    def not_found(err: Any) -> Response:
        return _error_response(
            ApiError(err.code, f"{request.method} {request.path}: {err.description}", "not_found_error")
        )

    return app


def _route() -> str:
    """The matched URL rule (bounded label values for metrics), not the raw path."""
    return request.url_rule.rule if request.url_rule is not None else "unmatched"


def _reason_of(response: Response) -> str:
    if response.status_code < 400:
        return ""
    try:
        error = json.loads(response.get_data()).get("error", {})
        return str(error.get("code") or error.get("type") or response.status_code)
    except (ValueError, AttributeError):
        return str(response.status_code)


def serve_openai_server(cfg: DeploymentConfig) -> int:
    """Run the OpenAI-compatible server in this process until SIGTERM/SIGINT."""
    keys = ApiKeys.load(cfg.api_key_file)
    client = Client(cfg.lb_address, deployment_name=cfg.deployment_name)
    banner = (
        f"OpenAI-compatible server on {cfg.openai_url} (model {cfg.served_model!r}, "
        f"{'API key required' if keys.required else 'no API key'}) -> {cfg.lb_address}"
    )
    try:
        serve_wsgi(
            create_app(cfg, client, keys), cfg.openai_api_host, cfg.openai_api_port, cfg.openai_api_threads, banner,
            # why: keep reading the socket while a request runs, so a client that leaves is seen at once
            channel_request_lookahead=1,
        )  # fmt: skip
    finally:
        client.close()
    return 0
