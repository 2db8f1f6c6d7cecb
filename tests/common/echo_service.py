"""A minimal real gRPC service for testing the shared runtime in real processes.

`python -m tests.common.echo_service serve` starts an Echo server through pcpstack.common.server and
prints its port; `python -m tests.common.echo_service call ADDRESS TEXT` calls it once and prints the
client's trace id. Both set up telemetry first, as every service entry point does.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.server import ServerOptions, serve_until_signalled, start_server
from pcpstack.common.telemetry import current_trace_id, setup_telemetry, shutdown_telemetry, tracer

SERVICE = "test.Echo"
METHOD = f"/{SERVICE}/Echo"
COUNT_METHOD = f"/{SERVICE}/Count"
_identity = bytes


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"sleep":
        await asyncio.sleep(10)
    with tracer(__name__).start_as_current_span("echo.work"):
        return request


async def _count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """Streams int(request) messages of 64 KiB, each its number in text padded with spaces, as fast as
    the client reads them (the stream waits at its yields, as a decode worker's does)."""
    for n in range(int(request)):
        yield str(n).encode().ljust(64 << 10)


def register(server: grpc.aio.Server) -> None:
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(
            _echo, request_deserializer=_identity, response_serializer=_identity
        ),
        "Count": grpc.unary_stream_rpc_method_handler(
            _count, request_deserializer=_identity, response_serializer=_identity
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def serve(max_message_bytes: int) -> None:
    running = await start_server(register, [SERVICE], ServerOptions(max_message_bytes=max_message_bytes))
    print(running.port, flush=True)
    await serve_until_signalled(running)
    print("stopped", flush=True)


async def call(address: str, text: str) -> None:
    async with open_channel(address) as channel:
        with tracer(__name__).start_as_current_span("client.request"):
            trace_id = current_trace_id()
            reply = await channel.unary_unary(METHOD)(text.encode())
    print(trace_id, reply.decode(), flush=True)


def main() -> None:
    mode = sys.argv[1]
    setup_telemetry(f"echo-{mode}")
    try:
        if mode == "serve":
            asyncio.run(serve(int(sys.argv[2]) if len(sys.argv) > 2 else 4 * 1024 * 1024))
        else:
            asyncio.run(call(sys.argv[2], sys.argv[3]))
    finally:
        shutdown_telemetry()


if __name__ == "__main__":
    main()
