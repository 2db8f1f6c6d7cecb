"""A KV store with a token refuses Lookup and PrepareStandby without it, as it refuses Put: both change what
it holds (a lookup's lease pins objects, a standby evicts and creates segments). A real store on 127.0.0.1
and real channels."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pcpstack.common import security
from pcpstack.common.channel import open_channel
from pcpstack.common.server import ServerOptions
from pcpstack.kvstore.server import KvStoreServerConfig, serve
from pcpstack.v1 import kvstore_pb2 as pb
from pcpstack.v1 import kvstore_pb2_grpc
from tests.security.conftest import TOKEN, token_only

CALLS = {
    "Lookup": pb.LookupRequest(block_keys=["b0"], fingerprint="fp"),
    "PrepareStandby": pb.PrepareStandbyRequest(size_bytes=16 << 20),
    "Stat": pb.StatRequest(),  # counters stay open to anyone
}


async def _codes(address: str, channel_security: security.Security) -> dict[str, grpc.StatusCode]:
    codes = {}
    async with open_channel(address, default_deadline=5, security=channel_security) as channel:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(channel)
        for method, request in CALLS.items():
            try:
                await getattr(stub, method)(request)
                codes[method] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                codes[method] = exc.code()
    return codes


@pytest.mark.timeout(30)
def test_lookup_and_prepare_standby_need_the_token():
    async def body():
        config = KvStoreServerConfig(capacity_bytes=64 << 20)
        server = await serve(config, ServerOptions(security=token_only(TOKEN)))
        try:
            without = await _codes(server.address, security.PLAINTEXT)
            wrong = await _codes(server.address, token_only("not-the-token-0123456789"))
            holder = await _codes(server.address, token_only(TOKEN))
            stat = server.servicer.store.stats()
        finally:
            await server.stop(grace=0)
        refused = {
            "Lookup": grpc.StatusCode.UNAUTHENTICATED,
            "PrepareStandby": grpc.StatusCode.UNAUTHENTICATED,
        }
        assert without == wrong == {**refused, "Stat": grpc.StatusCode.OK}
        assert holder == dict.fromkeys(CALLS, grpc.StatusCode.OK)
        assert stat.prefix_lookups == 1  # only the token holder's lookup reached the store

    asyncio.run(body())
