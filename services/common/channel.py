"""The one way a pcpstack client opens a channel: every call gets a deadline and the process's security.

A call made without an explicit timeout gets the channel's default deadline, so no RPC can wait forever
on a peer that went silent. The channel uses mutual TLS and attaches the bearer token when the process's
security (pcpstack.common.security) configures them, unless the caller passes its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from pcpstack.common import security as security_mod
from pcpstack.common.server import DEFAULT_MAX_MESSAGE_BYTES
from pcpstack.common.telemetry import client_interceptors

DEFAULT_DEADLINE_SECONDS = 30.0
# A peer that restarts (a KV store, a prefill node) is found again within two seconds: gRPC's own
# reconnect backoff grows to two minutes, far longer than a registry lease. Each channel keeps its own
# subchannels, so a channel opened after a peer failed does not inherit another channel's backoff.
RECONNECT_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
)


def _prepare(
    details: grpc.aio.ClientCallDetails, deadline: float, metadata: tuple[tuple[str, str], ...]
) -> grpc.aio.ClientCallDetails:
    if details.timeout is not None and not metadata:
        return details
    timeout = deadline if details.timeout is None else details.timeout
    merged = details.metadata
    if metadata:
        merged = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in metadata:
            if key not in merged:  # a caller's own value wins
                merged.add(key, value)
    return grpc.aio.ClientCallDetails(
        details.method, timeout, merged, details.credentials, details.wait_for_ready
    )


class _Prepared:
    def __init__(self, deadline: float, metadata: tuple[tuple[str, str], ...]) -> None:
        self._deadline = deadline
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return _prepare(details, self._deadline, self._metadata)


class _UnaryUnary(_Prepared, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_Prepared, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_Prepared, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_Prepared, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def open_channel(
    target: str,
    *,
    default_deadline: float = DEFAULT_DEADLINE_SECONDS,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, object]] = (),
    security: security_mod.Security | None = None,
) -> grpc.aio.Channel:
    """An aio channel to target whose calls time out after default_deadline seconds unless told otherwise.

    Long-lived streams (a registry Session) must pass their own, longer timeout. security defaults to the
    process's (security.current()); pass security.PLAINTEXT for a deliberately plain channel.
    """
    security = security if security is not None else security_mod.current()
    metadata = security.call_metadata()
    kinds = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    # Tracing outermost: its span covers the deadline and the metadata set here.
    interceptors = [*client_interceptors(), *(cls(default_deadline, metadata) for cls in kinds)]
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *RECONNECT_OPTIONS,
        *extra_options,
    ]
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
