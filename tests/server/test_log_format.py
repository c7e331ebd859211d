"""JSON log lines: one object a line, with the message's key=value pairs as fields."""

from __future__ import annotations

import json
import logging

from mii_server.serving.log_format import JsonFormatter


def test_json_lines_carry_request_ids() -> None:
    record = logging.LogRecord(
        "mii_server.replica.servicer", logging.INFO, __file__, 1,
        "request_id=%s uid=%d finished reason=%s", ("abc-123", 7, "length"), None,
    )  # fmt: skip
    entry = json.loads(JsonFormatter("replica").format(record))
    assert entry["message"] == "request_id=abc-123 uid=7 finished reason=length"
    assert (entry["request_id"], entry["uid"], entry["reason"]) == ("abc-123", "7", "length")
    assert (entry["level"], entry["role"], entry["logger"]) == ("INFO", "replica", "mii_server.replica.servicer")
