"""telemetry.current_in_steps: a span current while a stream makes each item, never across its yields, so
a stream closed from another context (a hung-up client's, closed later) resets nothing there."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext

from pcpstack.common.telemetry import current_in_steps


def test_the_span_is_current_in_each_step_only_and_closing_elsewhere_logs_nothing(caplog) -> None:
    span = NonRecordingSpan(SpanContext(trace_id=7, span_id=9, is_remote=False))
    closed = []

    async def stream() -> AsyncIterator[trace.Span]:
        try:
            for _ in range(3):
                yield trace.get_current_span()
        finally:
            closed.append(trace.get_current_span())

    async def first_item():
        items = current_in_steps(span, stream())
        seen = await anext(items)
        return items, seen, trace.get_current_span()

    with caplog.at_level(logging.ERROR):
        items, seen, between = asyncio.run(first_item())
        asyncio.run(items.aclose())  # another event loop: another context, as a garbage collector's
    assert seen is span and between is not span
    assert len(closed) == 1
    assert "Failed to detach" not in caplog.text
