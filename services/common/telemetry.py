"""OpenTelemetry set-up shared by every process: traces, metrics and the gRPC instrumentation.

`setup_telemetry` must run before any gRPC server or channel is created, because the gRPC
instrumentation works by wrapping the constructors. Exporters:
- OTLP (gRPC) when OTEL_EXPORTER_OTLP_ENDPOINT is set, the standard OpenTelemetry variable;
- a JSON-lines span file when PCPSTACK_TRACE_FILE is set, which tests use to collect the spans of
  several processes without running a collector.
Health checks and reflection calls are left out of traces: they are noise, not requests.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import (
    GrpcAioInstrumentorClient,
    GrpcAioInstrumentorServer,
    GrpcInstrumentorClient,
    filters,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

TRACE_FILE_ENV = "PCPSTACK_TRACE_FILE"
OTLP_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"

_lock = threading.Lock()
_service: str | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON object per line; safe for several processes (O_APPEND)."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": span.resource.attributes.get("service.name"),
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "parent_span_id": format(span.parent.span_id, "016x") if span.parent else None,
                        "kind": span.kind.name,
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
                        "status": span.status.status_code.name,
                    }
                )
            )
        if lines:
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, ("\n".join(lines) + "\n").encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS


def _jsonable(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def read_span_file(path: str | Path) -> list[dict]:
    """Reads spans written by JsonLinesSpanExporter."""
    text = Path(path).read_text() if Path(path).exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def setup_telemetry(
    service_name: str, metric_readers: Sequence[MetricReader] = (), metrics_address: str = ""
) -> None:
    """Installs tracer and meter providers for this process and instruments gRPC (idempotent).

    Call once per process, before creating gRPC servers or channels. metrics_address ("host:port") also
    serves the metrics for Prometheus to scrape at http://host:port/metrics.
    """
    global _service
    with _lock:
        if _service is not None:
            return
        _service = service_name
        resource = Resource.create({"service.name": service_name})
        provider = TracerProvider(resource=resource)
        readers = list(metric_readers)
        if metrics_address:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import start_http_server

            host, _, port = metrics_address.rpartition(":")
            start_http_server(int(port), addr=host or "127.0.0.1")
            readers.append(PrometheusMetricReader())
        if os.environ.get(OTLP_ENV):
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        if trace_file := os.environ.get(TRACE_FILE_ENV):
            # Simple (synchronous) so that a process killed right after a request still wrote its spans.
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
        not_noise = filters.negate(
            filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
        )
        GrpcAioInstrumentorServer(filter_=not_noise).instrument()
        GrpcAioInstrumentorClient(filter_=not_noise).instrument()
        GrpcInstrumentorClient(filter_=not_noise).instrument()


def shutdown_telemetry() -> None:
    """Flushes spans and metrics (call before the process exits)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush()
        provider.shutdown()
    meter_provider = metrics.get_meter_provider()
    if isinstance(meter_provider, MeterProvider):
        meter_provider.shutdown()


def current_trace_id() -> str:
    """Hex trace id of the active span, or an empty string outside any trace."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def tracer(name: str) -> trace.Tracer:
    """A tracer for one module."""
    return trace.get_tracer(name)


def meter(name: str) -> metrics.Meter:
    """A meter for one module."""
    return metrics.get_meter(name)
