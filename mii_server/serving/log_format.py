"""Log lines of every deployment process: plain text, or one JSON object a line for log shippers.

``MII_SERVER_LOG_FORMAT=json`` (inherited by every child) switches to JSON; the ``key=value``
pairs our messages carry (``request_id=...``, ``uid=...``) become fields of their own, so a request
can be followed from gateway to replica by filtering on ``request_id``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

FORMAT_ENV = "MII_SERVER_LOG_FORMAT"
_PAIR = re.compile(r"\b([a-z_]+)=(\S+)")


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "role": self.role,
            "pid": record.process,
            "logger": record.name,
            "message": message,
        }
        for key, value in _PAIR.findall(message):
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(role: str) -> None:
    """Configure the root logger of a deployment process playing ``role``."""
    fmt = os.environ.get(FORMAT_ENV, "text").lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"{FORMAT_ENV} must be text or json, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role}[%(process)d] %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
