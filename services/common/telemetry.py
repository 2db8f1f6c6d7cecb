"""OpenTelemetry set-up shared by every process: traces, metrics and the gRPC instrumentation.

`setup_telemetry` must run before any gRPC server or channel is created: servers and channels take their
tracing interceptors when they are made (server_interceptors, client_interceptors). Exporters:
- OTLP (gRPC) when OTEL_EXPORTER_OTLP_ENDPOINT is set, the standard OpenTelemetry variable (metrics
  too unless OTEL_METRICS_EXPORTER=none);
- a JSON-lines span file when PCPSTACK_TRACE_FILE is set, which tests use to collect the spans of
  several processes without running a collector;
- Prometheus text at http://HOST:PORT/metrics when a service runs with --metrics HOST:PORT (the gateway
  serves the same exposition on its own /metrics).
Health checks and reflection calls are left out of traces: they are noise, not requests.

Metric names. OpenTelemetry instrument names may not contain a colon, but operators (and the Gateway API
inference extension) expect vLLM's convention of a `vllm:` style namespace. So every pcpstack instrument is
named `pcpstack.<name>` (with a unit where it has one) and the Prometheus exposition renames what the
OpenTelemetry exporter makes of it, `pcpstack_<name>_<unit>`, to `pcpstack:<name>_<unit>`:
`pcpstack.time_to_first_token` in seconds is scraped as `pcpstack:time_to_first_token_seconds`. Metrics of
the gRPC instrumentation keep their OpenTelemetry names.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import (
    GrpcInstrumentorClient,
    aio_client_interceptors,
    aio_server_interceptor,
    filters,
)
from opentelemetry.instrumentation.grpc._aio_client import UnaryUnaryAioClientInterceptor
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

from pcpstack.common.config import ConfigError, unbindable

TRACE_FILE_ENV = "PCPSTACK_TRACE_FILE"
# The namespace of pcpstack's metrics as Prometheus sees them, and the instrument-name prefix it comes from.
METRIC_NAMESPACE = "pcpstack:"
_EXPORTED_PREFIX = "pcpstack_"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Histogram bounds (seconds) for request latencies: from a millisecond (a decode step of a tiny model) to
# ten minutes (a long generation), dense where TTFT and TPOT of real models fall. The OpenTelemetry default
# bounds are meant for milliseconds and would put every observation here in the first bucket.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
OTLP_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
# The standard switch for metric exporters; "none" keeps metrics off OTLP (compose: Prometheus scrapes).
METRICS_EXPORTER_ENV = "OTEL_METRICS_EXPORTER"

_lock = threading.Lock()
_service: str | None = None
T = TypeVar("T")
# Which calls a server or a channel traces (all but health checks and reflection); None until setup_telemetry.
_server_filter = None


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


class _Namespaced:
    """A prometheus_client collector that yields another registry's families with `pcpstack_` names
    renamed to `pcpstack:` (see the module docstring)."""

    def __init__(self, source: object) -> None:
        self._source = source

    def collect(self) -> Iterator[object]:
        for family in self._source.collect():  # type: ignore[attr-defined]
            old = family.name
            if old.startswith(_EXPORTED_PREFIX):
                new = METRIC_NAMESPACE + old[len(_EXPORTED_PREFIX) :]
                family.name = new
                family.samples = [
                    s._replace(name=new + s.name[len(old) :]) if s.name.startswith(old) else s
                    for s in family.samples
                ]
            yield family


class PrometheusEndpoint:
    """One Prometheus exposition of a meter provider: a reader to give the provider, and its text.

    Each endpoint has registries of its own (not prometheus_client's global one), so that several in one
    process, as in tests, never see each other's metrics.
    """

    def __init__(self) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        raw = CollectorRegistry(auto_describe=False)
        # Scope labels (the Python module that made the instrument) would only split series apart.
        self.reader = PrometheusMetricReader(registry=raw, scope_info_enabled=False)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Namespaced(raw))  # type: ignore[arg-type]

    def render(self) -> bytes:
        """The Prometheus text exposition, names under `pcpstack:`."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, address: str) -> None:
        """Serves the exposition at http://address/metrics from a daemon thread (address: HOST:PORT)."""
        from prometheus_client import start_http_server

        host, _, port = address.rpartition(":")
        try:
            start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        except OSError as exc:  # the port in use, or a host name that does not resolve here
            raise unbindable("--metrics", address, exc) from None


def latency_histogram(m: metrics.Meter, name: str, description: str) -> metrics.Histogram:
    """A histogram of seconds with LATENCY_BUCKETS_S bounds; name is `pcpstack.<name>` (no unit)."""
    return m.create_histogram(
        name, unit="s", description=description, explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S
    )


def setup_telemetry(
    service_name: str, metric_readers: Sequence[MetricReader] = (), metrics_address: str = ""
) -> None:
    """Installs tracer and meter providers for this process and instruments gRPC (idempotent).

    Call once per process, before creating gRPC servers or channels. metrics_address ("host:port") also
    serves the metrics for Prometheus to scrape at http://host:port/metrics.
    """
    global _service, _server_filter
    with _lock:
        if _service is not None:
            return
        _service = service_name
        resource = Resource.create({"service.name": service_name})
        provider = TracerProvider(resource=resource)
        readers = list(metric_readers)
        if metrics_address:
            endpoint = PrometheusEndpoint()
            try:
                endpoint.serve(metrics_address)
            except ConfigError:
                _service = None  # not set up: a later call may try again
                raise
            readers.append(endpoint.reader)
        if os.environ.get(OTLP_ENV):
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            if os.environ.get(METRICS_EXPORTER_ENV, "otlp").strip().lower() != "none":
                readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        if trace_file := os.environ.get(TRACE_FILE_ENV):
            _check_trace_file(trace_file)
            # Simple (synchronous) so that a process killed right after a request still wrote its spans.
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
        not_noise = filters.negate(
            filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
        )
        # aio servers and channels trace through server_interceptors() and client_interceptors(), not
        # patched constructors; blocking channels (none of pcpstack's own) keep OpenTelemetry's patch
        _server_filter = not_noise
        GrpcInstrumentorClient(filter_=not_noise).instrument()


def _check_trace_file(path: str) -> None:
    """Refuses a PCPSTACK_TRACE_FILE that no span could be written to (a folder, or a file in a folder that
    is missing or read-only): each span would log a traceback instead."""
    where = Path(path)
    if where.is_dir() or not where.parent.is_dir() or not os.access(where.parent, os.W_OK | os.X_OK):
        raise ConfigError.broken(TRACE_FILE_ENV, path, "must be a file in a folder this process can write")


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The interceptors that trace a gRPC server's calls, outermost first ([] before setup_telemetry).

    OpenTelemetry's server interceptor keeps a streaming call's span current across the stream's yields,
    and grpcio never closes an abandoned stream in its call's task: when a client hangs up, the stream is
    closed later by the garbage collector, in another context, where resetting the span's context fails
    and is logged at ERROR with a traceback ("Failed to detach context"), once per hung-up stream. So an
    outer interceptor drives each stream and closes it in its own task whatever ends it. OpenTelemetry's
    layer does not close the layers inside it, which the collector still closes elsewhere: none of them
    may keep a context across a yield (decode's request span is current in steps: current_in_steps)."""
    if _server_filter is None:
        return []
    return [_StreamsClosedInTheirTask(), aio_server_interceptor(filter_=_server_filter)]


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The interceptors that trace a channel's calls, outermost first ([] before setup_telemetry):
    OpenTelemetry's, but for unary calls one that hands the call back at once (_CancellableUnary)."""
    if _server_filter is None:
        return []
    unary, *streams = aio_client_interceptors(filter_=_server_filter)
    return [_CancellableUnary(unary._tracer, filter_=_server_filter), *streams]


_span_endings: set[asyncio.Task] = set()


class _CancellableUnary(UnaryUnaryAioClientInterceptor):
    """OpenTelemetry's client span of a unary call, ended when the call ends. OpenTelemetry's own waits for
    the call's status inside the interceptor, and grpcio cancels an intercepted call only once its
    interceptors have handed it back: a caller that left (decode's client hanging up on a queued prefill)
    could not cancel the call, which ran on at the server."""

    async def _wrap_unary_response(self, continuation, span):
        try:
            call = await continuation()
        except BaseException as exc:
            self.add_error_details_to_span(span, exc)
            span.end()
            raise
        call.add_done_callback(lambda done: self._end_soon(span, done))
        return call

    def _end_soon(self, span: trace.Span, call: grpc.aio.Call) -> None:
        ending = asyncio.ensure_future(self._end(span, call))
        _span_endings.add(ending)  # a task nobody holds may be collected before it runs
        ending.add_done_callback(_span_endings.discard)

    async def _end(self, span: trace.Span, call: grpc.aio.Call) -> None:
        try:
            code, details = await call.code(), await call.details()  # the call is over: at once
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(trace.Status(trace.StatusCode.ERROR, details))
        finally:
            span.end()


class _StreamsClosedInTheirTask(grpc.aio.ServerInterceptor):
    """Serves a streaming answer by writing each message itself (grpcio's reader/writer form), so that the
    stream is closed in the call's own task when the call ends, is cancelled or fails."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler.response_streaming:
            return handler
        serializers = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_written(handler.unary_stream), *serializers)
        return grpc.stream_stream_rpc_method_handler(_written(handler.stream_stream), *serializers)


def _written(behaviour):
    async def write_all(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        responses = behaviour(request_or_iterator, context)
        if inspect.isawaitable(responses):  # a handler of the reader/writer form writes for itself
            return await responses
        try:
            async for response in responses:
                await context.write(response)
        finally:
            await responses.aclose()

    return write_all


def record_failure(span: trace.Span, exc: BaseException) -> None:
    """Marks span failed by exc, as leaving `start_as_current_span` by an exception does."""
    span.record_exception(exc)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


async def current_in_steps(span: trace.Span, stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """stream's items, with span the current span while each one is produced but never across a yield.

    A span made current around a generator's yields (`with start_as_current_span(...)`) is reset by
    whoever closes the generator: a stream abandoned by its client is closed later, in another context,
    where the reset fails and is logged at ERROR. Here every attach is undone within the same step."""
    current = trace.set_span_in_context(span)
    async with aclosing(stream):
        while True:
            token = otel_context.attach(current)
            try:
                item = await anext(stream)
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            yield item


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
