"""The one error model: a ServiceError raised in a servicer reaches a real gRPC caller as its status."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pcpstack.common import errors
from pcpstack.common.rpc_errors import error_from_rpc
from pcpstack.common.server import ServerOptions, start_server

SERVICE = "pcpstack.test.Errors"


def _register(server: grpc.aio.Server) -> None:
    async def unary(request: bytes, context) -> bytes:
        raise errors.InvalidArgument(f"field={request.decode()} is not allowed")

    async def streaming(request: bytes, context):
        yield b"first"
        raise errors.ResourceExhausted("no room left")

    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(unary),
                    "Streaming": grpc.unary_stream_rpc_method_handler(streaming),
                },
            )
        ]
    )


async def _calls() -> tuple[grpc.aio.AioRpcError, list[bytes], grpc.aio.AioRpcError]:
    running = await start_server(_register, [SERVICE], ServerOptions(port=0))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await channel.unary_unary(f"/{SERVICE}/Unary")(b"x")
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as streaming:
                async for message in channel.unary_stream(f"/{SERVICE}/Streaming")(b""):
                    received.append(message)
        return unary.value, received, streaming.value
    finally:
        await running.stop(0)


def test_service_errors_travel_as_their_grpc_status_and_come_back_as_the_same_kind() -> None:
    unary, received, streaming = asyncio.run(_calls())
    assert unary.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unary.details() == "field=x is not allowed"
    assert isinstance(error_from_rpc(unary), errors.InvalidArgument)
    assert received == [b"first"]
    assert streaming.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(error_from_rpc(streaming), errors.ResourceExhausted)


def test_an_unknown_status_keeps_its_name() -> None:
    error = errors.error_of_code("CANCELLED", "client went away")
    assert type(error) is errors.ServiceError and error.code == "CANCELLED"
    assert "client went away" in str(error)
