"""The one way a pcpstack client opens a channel: every call gets a deadline.

A call made without an explicit timeout gets the channel's default deadline, so no RPC can wait forever
on a peer that went silent.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.server import DEFAULT_MAX_MESSAGE_BYTES

DEFAULT_DEADLINE_SECONDS = 30.0


def _with_deadline(details: grpc.aio.ClientCallDetails, deadline: float) -> grpc.aio.ClientCallDetails:
    if details.timeout is not None:
        return details
    return grpc.aio.ClientCallDetails(
        details.method, deadline, details.metadata, details.credentials, details.wait_for_ready
    )


class _DeadlineUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_deadline(client_call_details, self._deadline), request)


class _DeadlineUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_deadline(client_call_details, self._deadline), request)


class _DeadlineStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_deadline(client_call_details, self._deadline), request_iterator)


class _DeadlineStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_deadline(client_call_details, self._deadline), request_iterator)


def open_channel(
    target: str,
    *,
    default_deadline: float = DEFAULT_DEADLINE_SECONDS,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, object]] = (),
) -> grpc.aio.Channel:
    """An aio channel to target whose calls time out after default_deadline seconds unless told otherwise.

    Long-lived streams (a registry Session) must pass their own, longer timeout.
    """
    interceptors = [
        cls(default_deadline)
        for cls in (_DeadlineUnaryUnary, _DeadlineUnaryStream, _DeadlineStreamUnary, _DeadlineStreamStream)
    ]
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *extra_options,
    ]
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
