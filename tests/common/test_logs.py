"""Structured logging: one JSON object per line with the service name and the request being served."""

from __future__ import annotations

import asyncio
import io
import json
import logging

from pcpstack.common import logs


def test_log_lines_carry_service_and_request_id_across_awaits(monkeypatch) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    # Restored after the test, so later tests keep pytest's own log handlers.
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(logs, "_service_name", logs._service_name)
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, "json")  # whatever stderr is (pytest -s on a terminal)
    logs.setup_logging("decode")
    handler = logging.getLogger().handlers[0]
    monkeypatch.setattr(handler, "stream", stream)

    async def serve(request_id: str) -> None:
        logs.request_id_var.set(request_id)
        await asyncio.sleep(0)
        logging.getLogger("test").info("served", extra={"tokens": 3})

    async def main() -> None:
        await asyncio.gather(serve("req-a"), serve("req-b"))

    asyncio.run(main())
    logging.getLogger("test").warning("outside")
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(e["service"], e["request_id"], e["message"]) for e in entries] == [
        ("decode", "req-a", "served"),
        ("decode", "req-b", "served"),
        ("decode", "", "outside"),
    ]
    assert entries[0]["tokens"] == 3 and entries[0]["level"] == "INFO"


def test_a_throttled_warning_logs_once_an_interval_per_key_and_counts_what_it_left_out(caplog) -> None:
    now = [100.0]
    warning = logs.ThrottledWarning(logging.getLogger("test.throttled"), interval_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        for _ in range(5):  # one set down, five requests in a second
            warning.warning("set-a", "could not reach %s", "set-a")
            now[0] += 0.2
        warning.warning("set-b", "could not reach %s", "set-b")  # another key has its own interval
        now[0] = 161.0
        warning.warning("set-a", "could not reach %s", "set-a")
        warning.warning("set-a", "could not reach %s", "set-a")
        now[0] = 300.0
        warning.warning("set-a", "could not reach %s", "set-a")
        warning.warning("set-a", "could not reach %s", "set-a")
        # Many keys: those idle for an interval are forgotten, with a line for what they left out.
        for k in range(logs.ThrottledWarning.MAX_KEYS):
            now[0] += 1
            warning.warning(f"set-{k}", "could not reach %s", k)
    messages = [record.getMessage() for record in caplog.records]
    assert messages[:5] == [
        "could not reach set-a",
        "could not reach set-b",
        "could not reach set-a (4 more like it not logged after the one 61 s before)",
        "could not reach set-a (1 more like it not logged after the one 139 s before)",
        "could not reach 0",
    ]
    assert "could not reach set-a (1 more like it not logged after the one 63 s before)" in messages
    assert len(messages) == 4 + logs.ThrottledWarning.MAX_KEYS + 1
