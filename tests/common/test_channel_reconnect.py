"""Channels find a restarted peer again: a channel opened after the peer came back connects at once, even
while an older channel to the same address is still backing off from the outage."""

from __future__ import annotations

import asyncio

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.server import ServerOptions, start_server
from tests.common.echo_service import METHOD, SERVICE, register


def test_new_channel_reaches_a_restarted_peer_while_an_old_one_backs_off() -> None:
    async def scenario() -> bytes:
        first = await start_server(register, [SERVICE], ServerOptions(host="127.0.0.1", port=0))
        address, port = first.address, first.port
        async with open_channel(address, default_deadline=2) as old:
            assert await old.unary_unary(METHOD)(b"before") == b"before"
            await first.stop(0)
            # Calls during the outage drive the old channel's subchannel into reconnect backoff.
            for _ in range(4):
                try:
                    await old.unary_unary(METHOD)(b"down", timeout=0.5)
                except grpc.aio.AioRpcError as error:
                    assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                await asyncio.sleep(0.3)
            second = await start_server(register, [SERVICE], ServerOptions(host="127.0.0.1", port=port))
            try:
                async with open_channel(address, default_deadline=2) as fresh:
                    return await fresh.unary_unary(METHOD)(b"after", timeout=1.0)
            finally:
                await second.stop(0)

    assert asyncio.run(scenario()) == b"after"
