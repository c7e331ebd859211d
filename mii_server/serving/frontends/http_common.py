"""What both HTTP front ends share: API keys, request ids, the access log and HTTP metrics, health, SSE.

No torch and no web framework: the REST gateway (Flask) and the OpenAI-compatible server (FastAPI)
each adapt ``HttpInstrumentation`` to their framework's hooks in a few lines, so a request is
identified, authenticated, logged and counted the same way whichever server it reaches.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InvalidRequest
from ...wire.types import ReplicaStats
from ..metrics import HttpMetrics

log = logging.getLogger(__name__)

API_KEY_ENV = "MII_SERVER_API_KEY"
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
HEALTH_TIMEOUT_S = 2.0
RETRY_AFTER_S = 1  # what a 503 tells the caller to wait
UNAUTHENTICATED = frozenset({"/health", "/healthz"})  # probes need no key
CLIENT_GONE_STATUS = 499  # nginx's "client closed request", for logs and metrics only
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


class ApiKeys:
    """The accepted API keys; none means no authentication. Keys come from the environment or a file,
    never from argv (command lines are visible to every user of the machine and land in logs)."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    @classmethod
    def load(cls, key_file: str = "", environ: dict[str, str] | None = None) -> ApiKeys:
        """Keys from ``$MII_SERVER_API_KEY`` (comma-separated) and ``key_file`` (one per line, # comments)."""
        env = os.environ if environ is None else environ
        keys = [k.strip() for k in env.get(API_KEY_ENV, "").split(",")]
        if key_file:
            try:
                text = Path(key_file).read_text()
            except OSError as err:
                raise InvalidRequest(f"cannot read api_key_file {key_file!r}: {err}") from None
            keys += [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
        return cls([k for k in keys if k])

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """True for ``Bearer <a known key>`` (or when no key is configured). Constant time per key, and
        every key is compared, so timing reveals neither the key nor which one matched."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        return ok


def request_id_from(header: str | None) -> str:
    """The caller's ``X-Request-Id`` when it is a sane token, else a fresh one (uuid4 hex)."""
    if header and _REQUEST_ID_RE.match(header):
        return header
    return uuid.uuid4().hex


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
