"""Where `ServiceError`s meet gRPC: the one mapping between pcpstack's error kinds and gRPC statuses.

Servers: `start_server` installs `ErrorInterceptor`, so a servicer method (or a core it calls) simply raises a
ServiceError and the caller receives its status and message; a servicer that has already streamed part of an
answer may also call `abort(context, error)`. A message that would not fit gRPC's metadata limits (one
quoting a huge bad value) is cut short, so that the caller still gets its status. Clients: `error_from_rpc`
turns a failed call back into the same kind.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any, NoReturn

import grpc

from pcpstack.common.errors import ServiceError, error_of_code

log = logging.getLogger(__name__)


# Bytes a status message may take on the wire (grpc-message is percent-encoded: a byte outside printable
# ASCII takes three). gRPC drops a response whose metadata passes 8 KiB (its soft limit, at random up to the
# hard 16 KiB), and the caller then reads RESOURCE_EXHAUSTED instead of the error: a message that quotes a
# huge bad value is cut well below that.
MAX_MESSAGE_WIRE_BYTES = 4096


def _wire_bytes(text: str) -> int:
    return sum(1 if 0x20 <= byte <= 0x7E and byte != 0x25 else 3 for byte in text.encode())


def clipped(message: str, limit: int = MAX_MESSAGE_WIRE_BYTES) -> str:
    """message as it may travel as a status message: whole when it fits limit bytes on the wire, else its
    beginning and how much was left out."""
    if _wire_bytes(message) <= limit:
        return message
    kept, size = [], 0
    budget = limit - 64  # room for the note of what was left out
    for char in message:
        size += _wire_bytes(char)
        if size > budget:
            break
        kept.append(char)
    return f"{''.join(kept)}... ({len(message) - len(kept)} more characters left out)"


def status_of(error: ServiceError) -> grpc.StatusCode:
    """The gRPC status an error travels as."""
    known = error.code in grpc.StatusCode.__members__
    return grpc.StatusCode[error.code] if known else grpc.StatusCode.UNKNOWN


async def abort(context: grpc.aio.ServicerContext, error: ServiceError) -> NoReturn:
    """Ends the call with the error's status and message. A call past its deadline is over already: its
    caller gets DEADLINE_EXCEEDED from gRPC, and an abort would fail in gRPC's core (an ERROR with two
    tracebacks), so the error is logged at INFO and the method ends as cancelled."""
    remaining = context.time_remaining()
    if context.done() or (remaining is not None and remaining <= 0):
        log.info("the call ended before its answer (%s: %s)", error.code, error)
        raise asyncio.CancelledError
    await context.abort(status_of(error), clipped(str(error)))


def error_from_rpc(exc: grpc.aio.AioRpcError) -> ServiceError:
    """The ServiceError of the kind a failed call's status names, with the server's message."""
    return error_of_code(exc.code().name, exc.details() or "")


def _unary(behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request_or_iterator, context):
        try:
            return await behaviour(request_or_iterator, context)
        except ServiceError as exc:
            await abort(context, exc)

    return wrapped


def _streaming(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapped(request_or_iterator, context):
        try:
            # aclosing: closing this stream closes the servicer's with it
            async with aclosing(behaviour(request_or_iterator, context)) as responses:
                async for response in responses:
                    yield response
        except ServiceError as exc:
            await abort(context, exc)

    return wrapped


def _wrap(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    return _streaming(behaviour) if inspect.isasyncgenfunction(behaviour) else _unary(behaviour)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers a ServiceError raised by any servicer method with its gRPC status and message."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        serializers = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary), *serializers)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream), *serializers)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary), *serializers)
        return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream), *serializers)
