"""The REST gateway: MII's ``POST /mii/<deployment>`` over HTTP, served by waitress (no torch).

Body ``{"prompts": str | [str, ...], "stream": bool, <generate kwargs>}``. Replies a JSON list of
responses (``Response.to_msg_dict()``), or with ``"stream": true`` server-sent events: one
``data: <chunk JSON with prompt_index>`` per chunk, then ``data: [DONE]``. Errors are JSON
``{"error": {"type", "message"}}`` with the status from ``status.http_status_of`` (400 for bad
JSON, unknown kwargs and wrong types). ``GET /healthz`` answers 200 while the process runs; ``GET /health``
200 while a replica can serve (503 otherwise); ``GET /metrics`` is Prometheus (``metrics``). API keys and
``X-Request-Id`` work as in the OpenAI server (``http_common``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from flask import Flask, Response, g, request, stream_with_context

from ...errors import DeploymentNotFound, InvalidRequest, MIIServerError
from ..control.deployment import DeploymentConfig
from ..metrics import EngineStatsCollector, HttpMetrics, exposition
from ..status import error_name_of, http_status_of
from .client import Client
from .http_common import REQUEST_ID_HEADER, ApiKeys, deployment_health, request_id_from, serve_wsgi

log = logging.getLogger(__name__)


def _error_body(exc: BaseException) -> dict[str, Any]:
    return {"error": {"type": error_name_of(exc), "message": str(exc)}}


def _error(exc: BaseException) -> tuple[Response, int]:
    status = http_status_of(exc)
    if status >= 500:
        log.warning("request failed: %s: %s", type(exc).__name__, exc)
    return Response(json.dumps(_error_body(exc)), status=status, mimetype="application/json"), status


def parse_body(raw: bytes) -> tuple[list[str], bool, dict[str, Any]]:
    """(prompts, stream, generate kwargs) from a request body; ``InvalidRequest`` when malformed."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidRequest(f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(
            'request body must be a JSON object like {"prompts": ["..."], "max_new_tokens": 32}'
        )
    if "prompts" not in body:
        raise InvalidRequest('request body lacks "prompts" (a string or a list of strings)')
    kwargs = dict(body)
    prompts = kwargs.pop("prompts")
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise InvalidRequest('"prompts" must be a string or a list of strings')
    stream = kwargs.pop("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest('"stream" must be true or false')
    return prompts, stream, kwargs


def create_app(
    deployment_name: str, client: Client, keys: ApiKeys | None = None, metrics: HttpMetrics | None = None
) -> Flask:
    """The Flask app; ``client`` talks to the load balancer and is shared by all requests.

    With ``keys``, every route but ``/healthz`` and ``/health`` needs ``Authorization: Bearer KEY``.
    """
    app = Flask("mii_server.rest_gateway")
    keys = keys or ApiKeys([])
    metrics = metrics or HttpMetrics()
    metrics.registry.register(EngineStatsCollector(lambda: client.stats(timeout=2.0)))

    @app.before_request
    def _begin() -> tuple[Response, int] | None:
        g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        g.started = time.monotonic()
        if request.path not in ("/healthz", "/health") and not keys.allows(
            request.headers.get("Authorization")
        ):
            body = {
                "error": {
                    "type": "Unauthorized",
                    "message": "missing or invalid API key (Authorization: Bearer)",
                }
            }
            return Response(json.dumps(body), status=401, mimetype="application/json"), 401
        return None

    @app.after_request
    def _end(response: Response) -> Response:
        response.headers[REQUEST_ID_HEADER] = g.request_id
        seconds = time.monotonic() - g.started
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        failed = "" if response.status_code < 400 else str(response.status_code)
        metrics.finished(route, response.status_code, seconds, failed)
        log.info(
            "request_id=%s method=%s path=%s status=%d duration_s=%.3f",
            g.request_id,
            request.method,
            request.path,
            response.status_code,
            seconds,
        )
        return response

    @app.get("/healthz")
    def healthz() -> Response:  # this process is up (the supervisor's readiness probe)
        return Response(json.dumps({"status": "ok"}), mimetype="application/json")

    @app.get("/health")
    def health() -> Response:  # the deployment can serve: a replica is loaded and routed to
        ok, detail = deployment_health(client)
        return Response(json.dumps(detail), status=200 if ok else 503, mimetype="application/json")

    @app.get("/metrics")
    def prometheus() -> Response:
        body, content_type = exposition(metrics.registry)
        return Response(body, content_type=content_type)

    @app.post("/mii/<name>")
    def generate(name: str) -> Any:
        try:
            if name != deployment_name:
                raise DeploymentNotFound(
                    f"no deployment named {name!r} here (this gateway serves {deployment_name!r})"
                )
            prompts, stream, kwargs = parse_body(request.get_data())
            if stream:
                # validates kwargs before returning
                chunks = client.generate_stream(prompts, request_id=g.request_id, **kwargs)
                return Response(
                    stream_with_context(_sse(chunks)),
                    mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            responses = client.generate(prompts, request_id=g.request_id, **kwargs)
        except MIIServerError as exc:
            return _error(exc)
        return Response(json.dumps([r.to_msg_dict() for r in responses]), mimetype="application/json")

    @app.errorhandler(404)
    @app.errorhandler(405)
    def not_found(err: Any) -> tuple[Response, int]:
        body = {
            "error": {"type": "NotFound", "message": f"{request.method} {request.path}: {err.description}"}
        }
        return Response(json.dumps(body), status=err.code, mimetype="application/json"), err.code

    return app


def _sse(chunks: Iterator[Any]) -> Iterator[str]:
    """Server-sent events: one per chunk, an ``error`` event if the stream fails, then [DONE]."""
    try:
        for chunk in chunks:
            body = chunk.to_msg_dict()
            yield f"data: {json.dumps(body)}\n\n"
    except MIIServerError as exc:
        yield f"event: error\ndata: {json.dumps(_error_body(exc))}\n\n"
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # the HTTP client left: cancel the upstream stream, aborting its requests
    yield "data: [DONE]\n\n"


def serve_rest_gateway(cfg: DeploymentConfig) -> int:
    """Run the gateway in this process until SIGTERM/SIGINT."""
    client = Client(cfg.lb_address, deployment_name=cfg.deployment_name)
    app = create_app(cfg.deployment_name, client, ApiKeys.load(cfg.api_key_file))
    banner = (
        f"REST gateway on http://{cfg.restful_api_host}:{cfg.restful_api_port}/mii/{cfg.deployment_name} "
        f"-> {cfg.lb_address}"
    )
    try:
        serve_wsgi(app, cfg.restful_api_host, cfg.restful_api_port, cfg.restful_api_threads, banner)
    finally:
        client.close()
    return 0
