"""What every HTTP front end shares: API keys, request ids, and a ``/health`` that asks the replicas.

No torch, no Flask: the REST gateway and the OpenAI-compatible server both call these.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import signal
import uuid
from pathlib import Path
from typing import Any

from ...errors import InvalidRequest
from .client import Client

API_KEY_ENV = "MII_SERVER_API_KEY"
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
HEALTH_TIMEOUT_S = 2.0


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


def deployment_health(client: Client) -> tuple[bool, dict[str, Any]]:
    """(healthy, detail): healthy when at least one replica has its engine loaded and is routed to."""
    try:
        replicas = client.stats(timeout=HEALTH_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - any failure to reach the load balancer is "unhealthy"
        return False, {"status": "unavailable", "error": f"load balancer unreachable: {err}"}
    healthy = sum(1 for r in replicas if r.healthy)
    detail = {
        "status": "ok" if healthy else "unavailable",
        "replicas": [{"index": r.replica_index, "healthy": r.healthy} for r in replicas],
    }
    return healthy > 0, detail


def serve_wsgi(app: Any, host: str, port: int, threads: int, banner: str, **waitress_options: Any) -> None:
    """Serve ``app`` with waitress (a production WSGI server) until SIGTERM or SIGINT."""
    import waitress  # why here: only the HTTP roles need it

    server = waitress.create_server(app, host=host, port=port, threads=threads, ident="mii-server", **waitress_options)

    def _stop(*_: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    logging.getLogger(__name__).info("%s", banner)
    try:
        server.run()
    except SystemExit:
        pass
    finally:
        server.close()
