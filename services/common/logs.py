"""Structured logging: one JSON object per line carrying the service name and the request id.

The request id lives in a context variable so that every log line written while a request is being
served carries it, across awaits, without threading it through every call.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_service_name = "pcpstack"


class JsonFormatter(logging.Formatter):
    """Formats records as JSON with ts, level, service, request_id, logger and message (plus extras)."""

    _standard = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(time.time(), 3),
            "level": record.levelname,
            "service": _service_name,
            "request_id": request_id_var.get(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in self._standard})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(service: str, level: str | int = "INFO") -> None:
    """Sends this process's logs to stderr as JSON lines tagged with the service name."""
    global _service_name
    _service_name = service
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
