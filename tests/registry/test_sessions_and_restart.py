"""Issue 22, registry side, through a registry process (or a real gRPC server for mTLS) and real clients.

- A live node id is bound to the session that registered it: another session (another process, another
  certificate) cannot register it, open its Session or deregister it until that session has ended.
- Just after a registry restart, before the nodes are back, routers keep the endpoints they had: the decode
  router and the gateway's worker pool do not answer "nothing is registered" while the registry warms up.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from pcpstack.cli.certs import write_certs
from pcpstack.common import security
from pcpstack.common.channel import open_channel
from pcpstack.common.config import EngineConfig
from pcpstack.common.errors import FailedPrecondition
from pcpstack.common.server import ServerOptions
from pcpstack.decode.router import SetRouter
from pcpstack.gateway.upstream import DecodePool
from pcpstack.registry.client import NodeSession, Resolver
from pcpstack.registry.membership import Settings
from pcpstack.registry.server import start_registry
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.registry.support import RegistryProcess, until, wait_serving

pytestmark = pytest.mark.timeout(90)
DECODE = EngineConfig(role="decode")
PREFILL = EngineConfig(data_parallel_size=1, nnodes=1, prefill_context_parallel_size=1)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 75))


async def _registered(session: NodeSession) -> NodeSession:
    await session.start()
    await session.wait_registered(timeout=15)
    return session


async def _decode_addresses(address: str) -> list[str]:
    """The registry's own answer (no client cache)."""
    async with open_channel(address, default_deadline=2.0) as channel:
        answer = await registry_pb2_grpc.RegistryServiceStub(channel).Resolve(registry_pb2.ResolveRequest())
    return [e.address for e in answer.decode]


def test_another_session_cannot_take_a_live_node_id_until_the_first_session_ends(child_env):
    async def scenario(address: str):
        await wait_serving(address)
        real = await _registered(NodeSession(address, "decode-0", "decode", "127.0.0.1:9500", DECODE))
        impostor = NodeSession(address, "decode-0", "decode", "127.0.0.2:9501", DECODE, in_use_patience_s=0.0)
        try:
            await impostor.start()
            with pytest.raises(FailedPrecondition, match="'decode-0' is bound to the live session"):
                await impostor.wait_registered(timeout=15)
            await impostor.close()
            assert await _decode_addresses(address) == ["127.0.0.1:9500"]
            async with open_channel(address, default_deadline=5.0) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Deregister(registry_pb2.DeregisterRequest(node_id="decode-0"))
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                call = stub.Session(timeout=5)
                opening = registry_pb2.SessionOpen(node_id="decode-0")
                await call.write(registry_pb2.SessionRequest(open=opening))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call.read()
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert await _decode_addresses(address) == ["127.0.0.1:9500"]
            assert real.connected  # the real node's Session was not taken over
            await real.close(deregister=True)
            successor = await _registered(
                NodeSession(address, "decode-0", "decode", "127.0.0.2:9501", DECODE)
            )
            assert await _decode_addresses(address) == ["127.0.0.2:9501"]
            await successor.close(deregister=True)
        finally:
            await real.close()

    with RegistryProcess(child_env, restore_grace_s=0) as registry:
        _run(scenario(registry.address))


def test_a_node_restarted_within_its_lease_gets_its_id_back_once_the_old_session_ends(child_env):
    async def scenario(address: str):
        await wait_serving(address)
        crashed = await _registered(NodeSession(address, "decode-0", "decode", "127.0.0.1:9500", DECODE))
        await crashed.close()  # no deregistration: the process died, its lease is still running
        # refused for good (FailedPrecondition) if the id stayed bound to the dead session
        restarted = await _registered(NodeSession(address, "decode-0", "decode", "127.0.0.1:9500", DECODE))
        try:
            async with open_channel(address, default_deadline=2.0) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                nodes = (await stub.ListNodes(registry_pb2.ListNodesRequest())).nodes
            assert [(n.node_id, n.state) for n in nodes] == [("decode-0", registry_pb2.NODE_STATE_READY)]
        finally:
            await restarted.close(deregister=True)

    with RegistryProcess(child_env, restore_grace_s=0) as registry:
        _run(scenario(registry.address))


def test_with_mtls_a_node_id_is_bound_to_the_certificate_that_registered_it(tmp_path: Path):
    write_certs(tmp_path, names=["server", "node", "other"], ips=["127.0.0.1"])

    def tls(name: str) -> security.Security:
        return security.load(
            security.SecuritySettings(
                ca_file=str(tmp_path / "ca.pem"),
                cert_file=str(tmp_path / f"{name}.pem"),
                key_file=str(tmp_path / f"{name}-key.pem"),
            )
        )

    # the same instance token from both: only the certificate differs (a copied token is not enough)
    request = registry_pb2.RegisterRequest(
        node_id="kv-0",
        role=common_pb2.NODE_ROLE_KVSTORE,
        address="127.0.0.1:9600",
        instance_id="token-of-kv-0",
    )

    async def register(address: str, name: str) -> grpc.StatusCode:
        async with open_channel(address, default_deadline=5, security=tls(name)) as channel:
            try:
                await registry_pb2_grpc.RegistryServiceStub(channel).Register(request)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    async def scenario():
        settings = Settings(lease_s=5.0, assembly_timeout_s=5.0, restore_grace_s=0.0)
        registry = await start_registry(settings, ServerOptions(security=tls("server")))
        try:
            assert await register(registry.address, "node") == grpc.StatusCode.OK
            assert await register(registry.address, "other") == grpc.StatusCode.FAILED_PRECONDITION
            assert await register(registry.address, "node") == grpc.StatusCode.OK
        finally:
            await registry.stop(grace=0)

    _run(scenario())


def test_routers_keep_their_endpoints_while_a_restarted_registry_has_not_heard_from_nodes(child_env):
    async def scenario(registry: RegistryProcess):
        address = registry.address
        await wait_serving(address)
        decode = await _registered(NodeSession(address, "decode-0", "decode", "127.0.0.1:9500", DECODE))
        prefill = await _registered(NodeSession(address, "prefill-0", "prefill", "127.0.0.1:9100", PREFILL))
        command = await prefill.next_command(timeout=15)
        a = command.assignment
        await prefill.report_status(a.set_id, a.generation, ready=True)
        resolver = Resolver(address, ttl_s=0.0)
        router = SetRouter(resolver.resolve, kv_fingerprint="")
        pool = DecodePool(registry_address=address)
        try:
            await until(lambda: _ready_set(resolver))
            assert (await router.choose()).set_id == a.set_id
            assert await pool.addresses() == ["127.0.0.1:9500"]
            registry.kill()
            # the nodes stay away (they would come back within a few seconds), so the restarted registry
            # has heard from nobody yet
            await decode.close()
            await prefill.close()
            registry.start()
            await wait_serving(address)
            assert await _decode_addresses(address) == []
            answer = await resolver.resolve(fresh=True)
            assert answer.warming and [e.address for e in answer.decode] == ["127.0.0.1:9500"]
            assert (await router.choose()).set_id == a.set_id
            assert await pool.addresses() == ["127.0.0.1:9500"]
            # once warm, the registry's answer is the truth again: nobody came back
            await until(lambda: _no_decode(resolver))
        finally:
            await pool.close()
            await resolver.close()
            await decode.close()
            await prefill.close()

    # as the local stack runs it: no restore grace, so only the warm-up protects the routers
    with RegistryProcess(child_env, restore_grace_s=0) as registry:
        _run(scenario(registry))


async def _ready_set(resolver: Resolver) -> bool:
    answer = await resolver.resolve(fresh=True)
    return bool(answer.prefill_sets and answer.decode)


async def _no_decode(resolver: Resolver) -> bool:
    return not (await resolver.resolve(fresh=True)).decode
