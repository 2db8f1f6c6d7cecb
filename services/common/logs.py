"""Logging of every service: readable lines on a terminal, one JSON object per line otherwise.

Both formats carry the service name and the request id. The request id lives in a context variable so
that every log line written while a request is being served carries it, across awaits, without threading
it through every call. The format follows stderr: a terminal gets the console format, anything else (a
file, a pipe, a log collector) gets JSON; PCPSTACK_LOG_FORMAT=json|console overrides the choice (another
value is a ConfigError: start-up refuses it).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from pcpstack.common.config import env_choice

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_service_name = "pcpstack"
LOG_FORMAT_ENV = "PCPSTACK_LOG_FORMAT"
LOG_FORMATS = {
    "": "console on a terminal, json otherwise",
    "json": "one JSON object per line",
    "console": "readable lines",
}
_STANDARD_FIELDS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats records as JSON with ts, level, service, request_id, logger and message (plus extras)."""

    _standard = _STANDARD_FIELDS

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


class ConsoleFormatter(logging.Formatter):
    """One readable line: time, level, service, logger, message, then request id and extras as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        line = f"{stamp} {record.levelname:<7} {_service_name} {record.name}: {record.getMessage()}"
        pairs = {"request_id": request_id_var.get()}
        pairs.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD_FIELDS})
        tail = " ".join(f"{k}={v}" for k, v in pairs.items() if v not in ("", None))
        if tail:
            line = f"{line}  [{tail}]"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def chosen_log_format() -> str:
    """PCPSTACK_LOG_FORMAT: "json", "console" or "" (unset); a ConfigError naming it for another value."""
    return env_choice(LOG_FORMAT_ENV, LOG_FORMATS)


def log_format(stream: TextIO) -> str:
    """ "console" or "json" for a stream: PCPSTACK_LOG_FORMAT if set, else console only on a terminal."""
    chosen = chosen_log_format()
    if chosen:
        return chosen
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def setup_logging(service: str, level: str | int = "INFO", stream: TextIO | None = None) -> None:
    """Sends this process's logs to stderr (or stream), tagged with the service name, in the format
    log_format chooses."""
    global _service_name
    _service_name = service
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(ConsoleFormatter() if log_format(stream) == "console" else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class ThrottledWarning:
    """A warning that can repeat many times a second while a peer is down: logged at most once per
    interval_s for each key (the peer and the kind of error), and the next line logged for that key says
    how many were left out since the one before. Once there are more than MAX_KEYS keys, those not logged
    for a whole interval are forgotten, each with a last line for what it left out."""

    MAX_KEYS = 64

    def __init__(
        self, logger: logging.Logger, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        # key -> (when last logged, that line's message, how many left out since)
        self._last: dict[str, tuple[float, str, int]] = {}

    def warning(self, key: str, message: str, *args: object, **kwargs: Any) -> None:
        """Logs message % args (kwargs: as Logger.warning takes them) unless this key's last line was
        logged under interval_s ago."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._interval_s:
            self._last[key] = (last[0], last[1], last[2] + 1)
            return
        text = message % args if args else message
        self._logger.warning(text + (self._left_out(last, now) if last else ""), **kwargs)
        self._last[key] = (now, text, 0)
        if len(self._last) > self.MAX_KEYS:
            for idle, (logged_at, logged, left_out) in list(self._last.items()):
                if now - logged_at >= self._interval_s:
                    del self._last[idle]
                    if left_out:
                        self._logger.warning(logged + self._left_out((logged_at, logged, left_out), now))

    @staticmethod
    def _left_out(last: tuple[float, str, int], now: float) -> str:
        logged_at, _, left_out = last
        if not left_out:
            return ""
        return f" ({left_out} more like it not logged after the one {now - logged_at:.0f} s before)"
