"""Calling any RPC of a service with generated messages, and judging the answer.

An answer is acceptable when it is OK or a gRPC status a handler chose: never UNKNOWN or INTERNAL (an
unhandled exception) and never DEADLINE_EXCEEDED (a hang on bad input).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

CALL_TIMEOUT_S = 20.0
REFUSED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}


class LoopRunner:
    """An event loop that synchronous hypothesis tests run coroutines on (servers live on it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def close(self) -> None:
        self.loop.close()


def methods(service: ServiceDescriptor) -> list[MethodDescriptor]:
    """Every method of a service, in proto order."""
    return list(service.methods)


async def call(
    channel: grpc.aio.Channel, method: MethodDescriptor, requests: list
) -> tuple[grpc.StatusCode, str]:
    """Calls method with requests (the first alone for a unary request); returns the final status."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_cls = message_factory.GetMessageClass(method.output_type)
    kinds = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    make = kinds[(method.client_streaming, method.server_streaming)]
    stub = make(
        path,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_cls.FromString,
    )
    # Streaming requests are written one by one: a server that ends the call early (a refusal) then
    # stops the writes, where a request iterator would make the client report its own INTERNAL error.
    answer = (
        stub(timeout=CALL_TIMEOUT_S) if method.client_streaming else stub(requests[0], timeout=CALL_TIMEOUT_S)
    )
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        if method.client_streaming:
            for request in requests:
                await answer.write(request)
            await answer.done_writing()
        if method.server_streaming:
            async for _ in answer:
                pass
        else:
            await answer
    return await answer.code(), await answer.details() or ""


async def serving(channel: grpc.aio.Channel, service: str = "") -> bool:
    """Whether the server answers its health check with SERVING."""
    answer = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10
    )
    return answer.status == health_pb2.HealthCheckResponse.SERVING


# gRPC Core's own status when a client's write races a server that already ended the call (a refusal of an
# early message); a servicer's unhandled exception is UNKNOWN, so this never hides a server crash.
CLIENT_WRITE_RACE = (grpc.StatusCode.INTERNAL, "Internal error from Core")


def judge(method: MethodDescriptor, code: grpc.StatusCode, details: str, requests: list) -> None:
    """Fails with the method, status and first request when the answer is not acceptable."""
    if method.client_streaming and (code, details) == CLIENT_WRITE_RACE:
        return
    assert code not in REFUSED, (
        f"{method.full_name} answered {code.name} ({details!r}) to {str(requests[0])[:500]!r}"
    )
