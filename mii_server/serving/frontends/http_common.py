"""What both HTTP front ends share: API keys, request ids, the access log and HTTP metrics, health, SSE,
the error ``code`` rule, CORS and the request body limit.

No torch and no web framework: the REST gateway (Flask) and the OpenAI-compatible server (FastAPI)
each adapt ``HttpInstrumentation`` to their framework's hooks in a few lines, so a request is
identified, authenticated, logged and counted the same way whichever server it reaches.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidRequest
from ...wire.request_ids import request_id_from
from ...wire.types import ReplicaStats
from ..metrics import HttpMetrics
from ..security import ApiKeys

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
HEALTH_TIMEOUT_S = 2.0
RETRY_AFTER_S = 1  # what a 503 tells the caller to wait
# Open without a key: the probes, the metrics (counts and latencies, no content: as vLLM, so a
# Prometheus scrape needs no secret) and the version. Everything else needs the key once one is set.
UNAUTHENTICATED = frozenset({"/health", "/healthz", "/metrics", "/version"})
CLIENT_GONE_STATUS = 499  # nginx's "client closed request", for logs and metrics only
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


@dataclass
class RequestScope:
    """One HTTP request as the instrumentation sees it."""

    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    failure: str = ""  # set by the handler: a short reason for the failure counter (error code)
    finished: bool = False


class HttpInstrumentation:
    """Request ids, API keys, the access log line and the HTTP metrics of one front end."""

    def __init__(self, keys: ApiKeys, metrics: HttpMetrics | None = None) -> None:
        self.keys = keys
        self.metrics = metrics or HttpMetrics()

    def begin(self, method: str, path: str, request_id_header: str | None) -> RequestScope:
        return RequestScope(request_id_from(request_id_header), method, path)

    def authorized(self, scope: RequestScope, authorization: str | None) -> bool:
        """Every route but the health probes needs a key once any key is configured."""
        return scope.path in UNAUTHENTICATED or self.keys.allows(authorization)

    def finish(self, scope: RequestScope, route: str, status: int) -> None:
        """Count and log a request once, when its last byte is out (or its client is gone)."""
        if scope.finished:
            return
        scope.finished = True
        seconds = time.monotonic() - scope.started
        reason = scope.failure or ("" if status < 400 else str(status))
        self.metrics.finished(route, status, seconds, reason)
        log.info(
            "request_id=%s method=%s path=%s status=%d duration_s=%.3f%s",
            scope.request_id,
            scope.method,
            route,
            status,
            seconds,
            f" error={reason}" if reason else "",
        )


def server_version() -> str:
    """The installed mii-server's version (``/version``)."""
    try:
        return importlib.metadata.version("mii-server")
    except importlib.metadata.PackageNotFoundError:  # a plain checkout on PYTHONPATH
        return "unknown"


def deployment_health(replicas: Sequence[ReplicaStats]) -> tuple[bool, dict[str, Any]]:
    """(healthy, detail): healthy when at least one replica has its engine loaded and is routed to."""
    healthy = sum(1 for r in replicas if r.healthy)
    detail = {
        "status": "ok" if healthy else "unavailable",
        "replicas": [{"index": r.replica_index, "healthy": r.healthy} for r in replicas],
    }
    return healthy > 0, detail


def unreachable_health(err: BaseException) -> dict[str, Any]:
    return {"status": "unavailable", "error": f"load balancer unreachable: {err}"}


def error_headers(status: int) -> dict[str, str]:
    """Headers an error reply carries: ``Retry-After`` on 503 (overloaded or no replica up)."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}


def sse_event(body: Any, event: str | None = None) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(body)}\n\n"


# ---- the error `code` rule ------------------------------------------------------------------------

# Every error body of both front ends has a ``code``, never null: OpenAI's code where OpenAI has one for
# the case, else one of ours. By error type name, most specific first (an error rebuilt from gRPC keeps
# the type the replica raised).
_CODES = {
    "InvalidJson": "invalid_json",
    "ContextLengthExceeded": "context_length_exceeded",  # OpenAI's
    "UnknownArgument": "unknown_parameter",  # OpenAI's
    "InvalidRequest": "invalid_value",  # OpenAI's
    "UnsupportedModel": "invalid_value",
    "CapacityExceeded": "overloaded",
    "ReplicaUnavailable": "unavailable",
    "EngineDead": "unavailable",
    "DeploymentNotFound": "not_found",
}
INVALID_JSON = "invalid_json"  # the body is not JSON (or nested too deep to parse)
REQUEST_TOO_LARGE = "request_too_large"  # 413
INVALID_API_KEY = "invalid_api_key"  # OpenAI's; 401
NOT_FOUND = "not_found"  # no such route
METHOD_NOT_ALLOWED = "method_not_allowed"
ORIGIN_NOT_ALLOWED = "origin_not_allowed"  # a CORS preflight from an origin not in allowed_origins
INTERNAL_ERROR = "internal_error"
CLIENT_DISCONNECTED = "client_disconnected"  # metrics and logs only: nobody reads the body


class InvalidJson(InvalidRequest):
    """A request body that is not JSON (bad syntax, bad UTF-8, or nested too deep to parse)."""


def error_code(exc: BaseException) -> str:
    """The ``code`` of a typed error's body (``internal_error`` for anything untyped)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _CODES:
            return _CODES[cls.__name__]
    return INTERNAL_ERROR


# ---- request body limit ---------------------------------------------------------------------------


def too_large_message(limit: int) -> str:
    return f"the request body is larger than this server accepts ({limit} bytes; max_request_body_bytes)"


# ---- CORS -----------------------------------------------------------------------------------------

CORS_METHODS = "GET, POST, OPTIONS"
CORS_DEFAULT_HEADERS = "Authorization, Content-Type, X-Request-Id"
CORS_MAX_AGE_S = 600


class CorsPolicy:
    """Opt-in CORS (``allowed_origins``): browser apps on those origins may call the API directly.

    Off (no origin listed): no CORS header is ever sent and an OPTIONS request is answered like any
    other method a route lacks. On: a request whose ``Origin`` is listed (or any, with ``*``) gets
    ``Access-Control-Allow-Origin``; a preflight (OPTIONS with ``Access-Control-Request-Method``) is
    answered 204 before authentication (browsers send no key on it), or 403 for an unlisted origin.
    No credentials mode: the API key travels in ``Authorization``, which the preflight allows.
    """

    def __init__(self, allowed_origins: Sequence[str] = ()) -> None:
        self.origins = frozenset(o.rstrip("/") for o in allowed_origins if o)
        self.any_origin = "*" in self.origins

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        return bool(origin) and (self.any_origin or origin in self.origins)

    @staticmethod
    def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
        """``headers`` with lower-case names."""
        return method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers

    def headers_for(self, origin: str | None) -> dict[str, str]:
        """The CORS headers of a reply to a request from ``origin`` (none when off or not listed)."""
        if not self.enabled or not self.allows(origin):
            return {}
        return {
            "Access-Control-Allow-Origin": "*" if self.any_origin else str(origin),
            "Access-Control-Expose-Headers": f"{REQUEST_ID_HEADER}, Retry-After",
            "Vary": "Origin",
        }

    def preflight(self, headers: Mapping[str, str]) -> tuple[int, dict[str, str]]:
        """(status, headers) of the reply to a preflight, besides ``headers_for`` (which every reply
        gets); ``headers`` with lower-case names."""
        if not self.allows(headers.get("origin")):
            return 403, {}
        return 204, {
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": headers.get("access-control-request-headers") or CORS_DEFAULT_HEADERS,
            "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
        }
