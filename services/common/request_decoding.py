"""Request bytes that are not a valid message: INVALID_ARGUMENT, not UNKNOWN.

gRPC Python decodes a request with the method's request deserializer before any servicer code runs, and an
exception there reaches the caller as UNKNOWN ("Unexpected <class 'DecodeError'>") with a server-side
traceback, as if the server had crashed. The deserializer has no way to choose a status (it sees only the
bytes), so `DecodingInterceptor` wraps it to return a `MalformedRequest` in place of the message, and wraps
the method so that receiving one ends the call with INVALID_ARGUMENT naming the method and the decoder's
reason. Streaming requests are checked message by message as the servicer reads them.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc

from pcpstack.common.errors import InvalidArgument
from pcpstack.common.rpc_errors import abort


@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request whose bytes did not decode; `reason` is the decoder's message."""

    reason: str


class MalformedRequestError(InvalidArgument):
    """A request message that is not a valid encoding of the method's request type."""


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # DecodeError, and whatever else a decoder raises on bytes it cannot read
            return MalformedRequest(f"{type(exc).__name__}: {exc}")

    return deserialize


def _refusal(method: str, request: MalformedRequest) -> MalformedRequestError:
    return MalformedRequestError(f"the request to {method} is not a valid message ({request.reason})")


async def _checked(method: str, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, MalformedRequest):
            raise _refusal(method, request)
        yield request


def _guard(method: str, behaviour: Callable[..., Any], request_streaming: bool) -> Callable[..., Any]:
    """behaviour, refusing a malformed request (or a malformed message of a request stream)."""

    def arguments(request: Any) -> Any:
        if request_streaming:
            return _checked(method, request)
        if isinstance(request, MalformedRequest):
            raise _refusal(method, request)
        return request

    if inspect.isasyncgenfunction(behaviour):

        async def streaming(request, context: grpc.aio.ServicerContext):
            try:
                # aclosing: closing this stream closes the servicer's with it
                async with aclosing(behaviour(arguments(request), context)) as responses:
                    async for response in responses:
                        yield response
            except MalformedRequestError as exc:
                await abort(context, exc)

        return streaming

    async def unary(request, context: grpc.aio.ServicerContext):
        try:
            return await behaviour(arguments(request), context)
        except MalformedRequestError as exc:
            await abort(context, exc)

    return unary


class DecodingInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that does not decode with INVALID_ARGUMENT (see the module docstring)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _guard(method, handler.unary_unary, False), deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _guard(method, handler.unary_stream, False), deserializer, handler.response_serializer
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _guard(method, handler.stream_unary, True), deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            _guard(method, handler.stream_stream, True), deserializer, handler.response_serializer
        )
