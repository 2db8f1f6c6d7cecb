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
