"""The one error model: a ServiceError raised in a servicer reaches a real gRPC caller as its status."""

from __future__ import annotations

import asyncio
import logging
import time

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


async def _calls(
    field: bytes = b"x",
) -> tuple[grpc.aio.AioRpcError, list[bytes], grpc.aio.AioRpcError]:
    running = await start_server(_register, [SERVICE], ServerOptions(port=0))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await channel.unary_unary(f"/{SERVICE}/Unary")(field)
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as streaming:
                async for message in channel.unary_stream(f"/{SERVICE}/Streaming")(b""):
                    received.append(message)
        return unary.value, received, streaming.value
    finally:
        await running.stop(0)


@pytest.mark.parametrize("char", ["x", "\u00e9"], ids=["ascii", "percent-encoded"])
def test_an_error_quoting_a_huge_value_still_reaches_the_caller_as_its_status(char: str) -> None:
    # Whole, the message would pass gRPC's metadata limit and the caller would read RESOURCE_EXHAUSTED.
    unary, _, _ = asyncio.run(_calls((char * 20_000).encode()))
    assert unary.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unary.details().startswith(f"field={char * 100}")
    assert unary.details().endswith("more characters left out)") and len(unary.details()) < 4096


def test_service_errors_travel_as_their_grpc_status_and_come_back_as_the_same_kind() -> None:
    unary, received, streaming = asyncio.run(_calls())
    assert unary.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unary.details() == "field=x is not allowed"
    assert isinstance(error_from_rpc(unary), errors.InvalidArgument)
    assert received == [b"first"]
    assert streaming.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(error_from_rpc(streaming), errors.ResourceExhausted)


def _register_late(server: grpc.aio.Server) -> None:
    async def late(request: bytes, context) -> bytes:
        # A busy node: its loop is held past the call's deadline, which gRPC has ended meanwhile.
        time.sleep(context.time_remaining() + 0.05)
        raise errors.DeadlineExceeded("prefill did not finish within the deadline")

    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"Late": grpc.unary_unary_rpc_method_handler(late)})]
    )


async def _late_call() -> grpc.StatusCode:
    running = await start_server(_register_late, [SERVICE], ServerOptions(port=0))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await channel.unary_unary(f"/{SERVICE}/Late")(b"", timeout=0.5)
            await asyncio.sleep(0.2)  # the servicer's side of the call ends
        return late.value.code()
    finally:
        await running.stop(0)


def test_an_error_raised_after_the_calls_deadline_is_logged_at_info_and_not_sent(caplog) -> None:
    # gRPC has already answered DEADLINE_EXCEEDED; sending the error's status could only fail in gRPC's
    # core, which logs an ERROR with two tracebacks.
    caplog.set_level(logging.INFO)
    assert asyncio.run(_late_call()) == grpc.StatusCode.DEADLINE_EXCEEDED
    late = [record for record in caplog.records if record.name == "pcpstack.common.rpc_errors"]
    assert [record.levelno for record in late] == [logging.INFO]
    assert "prefill did not finish within the deadline" in late[0].getMessage()
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


def test_an_unknown_status_keeps_its_name() -> None:
    error = errors.error_of_code("CANCELLED", "client went away")
    assert type(error) is errors.ServiceError and error.code == "CANCELLED"
    assert "client went away" in str(error)
