"""The gateway's HTTP layer (aiohttp): routes, the tracing and metrics middleware, streaming over SSE.

Handlers stay thin: openai_requests parses, Decode.Generate runs, openai_responses shapes. Each /v1 request
gets a server span continuing the caller's `traceparent`; the gRPC client instrumentation carries it on to
decode. A streamed request waits for decode's first message before sending headers, so that a refused
request still gets its HTTP error status; an error after that is sent as a last `data: {"error": ...}` event.
A request for n samples runs n Generate calls (gateway/samples.py); their chunks interleave, each with its
choice index. The API key and CORS are middlewares (gateway/http_security.py); /tokenize and /detokenize are
gateway/tokenize.py's.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from opentelemetry import propagate, trace

from pcpstack.common.errors import InvalidArgument
from pcpstack.common.ids import check_request_id
from pcpstack.common.logs import request_id_var
from pcpstack.common.telemetry import current_trace_id, tracer
from pcpstack.gateway.errors import ApiError, bad_request, quoted, service_unavailable
from pcpstack.gateway.http_security import HttpSecurity
from pcpstack.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from pcpstack.gateway.openai_requests import ParsedRequest, load_body, parse_chat, parse_completion
from pcpstack.gateway.openai_responses import SSE_DONE, ResponseShaper, sse
from pcpstack.gateway.samples import generate_samples
from pcpstack.gateway.tokenize import Tokenization
from pcpstack.gateway.upstream import DecodePool
from pcpstack.v1 import decode_pb2

try:
    __version__ = importlib.metadata.version("pcpstack")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"
log = logging.getLogger(__name__)
# One line per /v1 request (method, path, status, duration, request id, trace id): the access log.
access_log = logging.getLogger("pcpstack.gateway.access")
_tracer = tracer(__name__)
REQUEST_ID_HEADER = "X-Request-Id"
# The status nginx logs for a client that closed the connection before the answer: no HTTP status was sent.
CLIENT_CLOSED_STATUS = 499
TRACE_ID_HEADER = "X-Trace-Id"


@dataclass(frozen=True)
class GatewaySettings:
    """What the HTTP layer needs beyond the decode pool."""

    model_name: str
    request_timeout_s: float = 600.0
    # The model whose tokenizer /tokenize and /detokenize use; None: they answer 501.
    tokenizer: str | None = None
    security: HttpSecurity = field(default_factory=HttpSecurity)


_SETTINGS = web.AppKey("settings", GatewaySettings)
_POOL = web.AppKey("pool", DecodePool)
_METRICS = web.AppKey("metrics", GatewayMetrics)
_STARTED = web.AppKey("started", int)
_TOKENIZATION = web.AppKey("tokenization", Tokenization)
_REQUEST_ID = web.RequestKey("request_id", str)
_TRACE_ID = web.RequestKey("trace_id", str)


class _MalformedHttpAtInfo(logging.Filter):
    """aiohttp logs a request it cannot parse (a client's malformed HTTP: a bad chunk size or
    Content-Length) as an ERROR with a traceback, though it is the client's fault and answered 400: such a
    record becomes one INFO line, so that clients cannot fill the log with tracebacks or trip alerts."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            reason = (exc.message or "").strip().splitlines()[0] if exc.message else ""
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.msg, record.args = "malformed HTTP request refused with %d: %s", (exc.code, reason)
            record.exc_info = record.exc_text = None
        return True


def _log_malformed_http_at_info() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(existing, _MalformedHttpAtInfo) for existing in server_log.filters):
        server_log.addFilter(_MalformedHttpAtInfo())


def create_app(pool: DecodePool, settings: GatewaySettings) -> web.Application:
    """The aiohttp application; the pool is closed when the app shuts down."""
    _log_malformed_http_at_info()
    app = web.Application(middlewares=[_observe], client_max_size=64 * 1024 * 1024)
    app[_SETTINGS] = settings
    app[_POOL] = pool
    app[_METRICS] = GatewayMetrics()
    app[_STARTED] = int(time.time())
    app[_TOKENIZATION] = Tokenization(settings.tokenizer, settings.model_name)
    settings.security.install(app)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/version", _version)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.on_response_prepare.append(_add_id_headers)

    async def close_pool(app: web.Application) -> None:
        await app[_POOL].close()
        app[_METRICS].close()

    app.on_cleanup.append(close_pool)
    return app


# Seconds a client is told to wait before it retries a 429 (every decode worker busy) or a 503.
RETRY_AFTER_S = 1


def _error_response(error: ApiError) -> web.Response:
    retry = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
    return web.json_response(error.body(), status=error.status, headers=retry)


def _http_error_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusal (404 no route, 405 wrong method, 413 body too large) in the OpenAI shape; a 405
    keeps its Allow header (RFC 9110 requires it) and names the methods the route takes."""
    allow = exc.headers.get("Allow")
    # aiohttp's text is "404: Not Found" unless it says more ("Maximum request body size ... exceeded").
    message = exc.reason if exc.text == f"{exc.status}: {exc.reason}" else f"{exc.reason}: {exc.text}"
    if allow:
        message = f"{exc.reason}: {request.method} {request.path} takes {allow}"
    response = _error_response(ApiError(exc.status, message, error_type="invalid_request_error"))
    if allow:
        response.headers["Allow"] = allow
    return response


async def _answer(request: web.Request, handler: Callable) -> tuple[web.StreamResponse, str | None]:
    """The handler's response, or the OpenAI-shaped answer to what it raised; with the error type, if any."""
    try:
        return await handler(request), None
    except ApiError as exc:
        return _error_response(exc), exc.error_type
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error_response(request, exc), "invalid_request_error"
    except Exception:
        log.exception("unexpected error serving %s", request.path)
        return _error_response(ApiError(500, "internal error", error_type="server_error")), "server_error"


@web.middleware
async def _observe(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Server span (continuing the caller's trace) and metrics for /v1 routes; OpenAI-shaped errors for
    every route."""
    if not request.path.startswith("/v1/"):
        return (await _answer(request, handler))[0]
    metrics = request.app[_METRICS]
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    started = time.perf_counter()
    metrics.started()
    with _tracer.start_as_current_span(
        f"{request.method} {endpoint}", context=propagate.extract(request.headers), kind=trace.SpanKind.SERVER
    ) as span:
        span.set_attribute("http.request.method", request.method)
        span.set_attribute("url.path", request.path)
        request[_TRACE_ID] = current_trace_id()
        try:
            response, error_type = await _answer(request, handler)
        except asyncio.CancelledError:
            # The client hung up (aiohttp then cancels the handler): still counted and logged, as 499.
            _account(request, endpoint, CLIENT_CLOSED_STATUS, started)
            raise
        if error_type is not None:
            metrics.error(endpoint, error_type)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(trace.StatusCode.ERROR)
    _account(request, endpoint, response.status, started)
    return response


def _account(request: web.Request, endpoint: str, status: int, started: float) -> None:
    """Counts a finished /v1 request and writes its access log line."""
    # A streamed answer has been written by now, so this is the whole request's time.
    duration = time.perf_counter() - started
    request.app[_METRICS].finished(endpoint, status, duration)
    access_log.info(
        "%s %s %d %.3fs",
        request.method,
        request.path,
        status,
        duration,
        extra={
            "method": request.method,
            "path": request.path,
            "status": status,
            "duration_s": round(duration, 6),
            "request_id": request.get(_REQUEST_ID, ""),
            "trace_id": request.get(_TRACE_ID, ""),
        },
    )


async def _add_id_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Tells the caller the request id and the trace id to look for in logs and traces."""
    if _REQUEST_ID in request:
        response.headers[REQUEST_ID_HEADER] = request[_REQUEST_ID]
    if request.get(_TRACE_ID):
        response.headers[TRACE_ID_HEADER] = request[_TRACE_ID]


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, "cmpl")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, "chatcmpl")


async def _generate(
    request: web.Request, parse: Callable[[object, str], ParsedRequest], id_prefix: str
) -> web.StreamResponse:
    """Parses, calls Decode.Generate and answers whole or streamed."""
    settings, pool = request.app[_SETTINGS], request.app[_POOL]
    request_id = _request_id(request)
    request[_REQUEST_ID] = request_id  # before the body is read: a refused body's answer and log carry it too
    request_id_var.set(request_id)
    parsed = parse(await _read_body(request), settings.model_name)
    detokenize = None
    if parsed.include_stop_str_in_output and parsed.stop:
        detokenize = await request.app[_TOKENIZATION].detokenizer("include_stop_str_in_output")
    special_text = None
    if not parsed.skip_special_tokens:
        special_text = await request.app[_TOKENIZATION].special_text("skip_special_tokens")
    shaper = ResponseShaper(parsed, f"{id_prefix}-{request_id}", int(time.time()), detokenize, special_text)
    messages = generate_samples(pool, parsed, request_id, settings.request_timeout_s)
    timer = _FirstToken(request.app[_METRICS], request.match_info.route.resource.canonical)
    try:
        first = await anext(messages)  # a refused request fails here, before any header is sent
        if parsed.stream:
            return await _stream(request, shaper, _chain(first, messages), timer, parsed.n)
        summaries: list[decode_pb2.GenerateSummary | None] = [None] * parsed.n
        async for index, message in _chain(first, messages):
            if message.HasField("delta"):
                timer.seen()
                shaper.add(message.delta, index)
            else:
                summaries[index] = message.summary
        ended = _ended(summaries)
        _count_tokens(request, ended)
        return web.json_response(shaper.response(ended))
    finally:
        await messages.aclose()  # cancels the calls still running: the client went away


def _request_id(request: web.Request) -> str:
    """The caller's X-Request-Id, checked by the rule every edge applies; a fresh id when none is given."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if not given:
        return uuid.uuid4().hex
    try:
        return check_request_id(given, field=REQUEST_ID_HEADER)
    except InvalidArgument as exc:
        raise bad_request(REQUEST_ID_HEADER, str(exc)) from None


class _FirstToken:
    """Observes the time to the first generated token, once."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str) -> None:
        self._metrics = metrics
        self.endpoint = endpoint
        self._started: float | None = time.perf_counter()

    def seen(self) -> None:
        if self._started is not None:
            self._metrics.first_token(self.endpoint, time.perf_counter() - self._started)
            self._started = None


async def _stream(
    request: web.Request,
    shaper: ResponseShaper,
    messages: AsyncIterator[tuple[int, decode_pb2.GenerateResponse]],
    timer: _FirstToken,
    n: int,
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    try:
        for chunk in shaper.opening_chunks():
            await response.write(sse(chunk))
        summaries: list[decode_pb2.GenerateSummary | None] = [None] * n
        try:
            async for index, message in messages:
                if message.HasField("delta"):
                    timer.seen()
                    chunk = shaper.delta_chunk(message.delta, index)
                    if chunk is not None:
                        await response.write(sse(chunk))
                else:
                    summaries[index] = message.summary
                    for chunk in shaper.finish_chunks(message.summary, index):
                        await response.write(sse(chunk))
            ended = _ended(summaries)
            for chunk in shaper.usage_chunks(ended):
                await response.write(sse(chunk))
            _count_tokens(request, ended)
        except ApiError as exc:
            request.app[_METRICS].error(timer.endpoint, exc.error_type)
            await response.write(sse(exc.body()))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.info("client went away; request cancelled")
    return response


async def _chain(
    first: tuple[int, decode_pb2.GenerateResponse],
    rest: AsyncIterator[tuple[int, decode_pb2.GenerateResponse]],
) -> AsyncIterator[tuple[int, decode_pb2.GenerateResponse]]:
    yield first
    async for message in rest:
        yield message


def _ended(summaries: list[decode_pb2.GenerateSummary | None]) -> list[decode_pb2.GenerateSummary]:
    """Every sample's summary; a stream that ended without one is a broken decode worker."""
    if any(summary is None for summary in summaries):
        raise ApiError(502, "a decode worker ended a stream without its summary", error_type="server_error")
    return summaries  # type: ignore[return-value]


def _count_tokens(request: web.Request, summaries: list[decode_pb2.GenerateSummary]) -> None:
    """Counts the prompt once and every sample's completion tokens."""
    if summaries:
        completion = sum(summary.completion_tokens for summary in summaries)
        request.app[_METRICS].tokens(summaries[0].prompt_tokens, completion)


def _model_card(request: web.Request) -> dict:
    return {
        "id": request.app[_SETTINGS].model_name,
        "object": "model",
        "created": request.app[_STARTED],
        "owned_by": "pcpstack",
    }


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def _model(request: web.Request) -> web.Response:
    card = _model_card(request)
    if request.match_info["model"] != card["id"]:
        raise ApiError(
            404,
            f"model {quoted(request.match_info['model'])} does not exist",
            param="model",
            code="model_not_found",
        )
    return web.json_response(card)


async def _read_body(request: web.Request) -> Any:
    """The request's JSON body (load_body); a body that cannot be read, such as one that is not the gzip
    its Content-Encoding says, is a 400 naming the body."""
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:
        # The rest cannot be read: marked read, so that aiohttp does not drain it after the answer (and
        # log this error again as unhandled); the connection closes once the answer is sent.
        request.content.feed_eof()
        request.protocol.close()
        cause = exc.__cause__
        if isinstance(cause, ContentEncodingError):
            encoding = quoted(request.headers.get("Content-Encoding", ""))
            message = (
                f"could not decode the request body as its Content-Encoding {encoding} says: send it "
                "compressed that way, or uncompressed without the header"
            )
        else:
            message = f"the request body could not be read: {getattr(cause, 'message', None) or exc}"
        raise bad_request("body", message) from None
    return load_body(raw, request.charset)


async def _tokenize(request: web.Request) -> web.Response:
    return web.json_response(await request.app[_TOKENIZATION].tokenize(await _read_body(request)))


async def _detokenize(request: web.Request) -> web.Response:
    return web.json_response(await request.app[_TOKENIZATION].detokenize(await _read_body(request)))


async def _version(request: web.Request) -> web.Response:
    """The pcpstack version, in vLLM's shape."""
    return web.json_response({"version": __version__})


async def _health(request: web.Request) -> web.Response:
    """200 while at least one decode worker answers its health check SERVING, else 503; also the Generate
    calls in flight per worker (how the requests are spread)."""
    serving = await request.app[_POOL].serving()
    if not serving:
        return _error_response(service_unavailable("no decode worker is serving"))
    in_flight = request.app[_POOL].in_flight()
    return web.json_response({"status": "ok", "decode_workers": serving, "in_flight": in_flight})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[_METRICS].render(), headers={"Content-Type": CONTENT_TYPE})
