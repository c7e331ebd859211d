"""The one rule for request ids, wherever they enter: an HTTP ``X-Request-Id`` or a gRPC ``request_id``.

An id is logged by every process a request crosses (``request_id=...``), so only a short token of
safe characters is kept as given; anything else (a newline that would forge a log line, a control
character, a megabyte of text) is replaced by a fresh id.
"""

from __future__ import annotations

import re
import uuid

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_from(value: str | None) -> str:
    """``value`` when it is 1-128 of ``[A-Za-z0-9._:-]``, else a fresh id (uuid4 hex)."""
    if value and _REQUEST_ID_RE.match(value):
        return value
    return uuid.uuid4().hex
