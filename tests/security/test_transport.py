"""Mutual TLS and the bearer token over real gRPC: a registry on 127.0.0.1 port 0 and real channels."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pcpstack.cli.launch import cli_command
from pcpstack.common import security
from pcpstack.common.channel import open_channel
from pcpstack.common.server import ServerOptions
from pcpstack.registry.membership import Settings
from pcpstack.registry.server import start_registry
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.conftest import ROOT
from tests.security.conftest import TOKEN, tls, token_only

FAST = Settings(lease_s=2.0, assembly_timeout_s=5.0, restore_grace_s=0.0)
KVSTORE = registry_pb2.RegisterRequest(
    node_id="kv-0", role=common_pb2.NODE_ROLE_KVSTORE, address="127.0.0.1:9600"
)


async def _register(address: str, channel_security: security.Security, metadata=None) -> grpc.StatusCode:
    async with open_channel(address, default_deadline=5, security=channel_security) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        try:
            await stub.Register(KVSTORE, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


async def _health(address: str, channel_security: security.Security) -> int:
    async with open_channel(address, default_deadline=5, security=channel_security) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        return answer.status


def _with_registry(server_security: security.Security, check) -> None:
    async def scenario():
        registry = await start_registry(FAST, ServerOptions(security=server_security))
        try:
            await check(registry.address)
        finally:
            await registry.stop(grace=0)

    asyncio.run(scenario())


def test_pcpstack_certs_writes_a_ca_and_certificates_that_load(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    done = subprocess.run(
        cli_command(
            "certs",
            "--out",
            str(out),
            "--name",
            "registry",
            "--ip",
            "10.1.2.3",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "ca-key.pem",
        "ca.pem",
        "registry-key.pem",
        "registry.pem",
    ]
    assert (out / "registry-key.pem").stat().st_mode & 0o077 == 0
    loaded = tls(out, "registry")
    assert loaded.tls is not None and loaded.server_credentials() is not None

    from cryptography import x509

    cert = x509.load_pem_x509_certificate((out / "registry.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["registry", "localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]


def test_a_tls_registry_refuses_a_plaintext_client(certs: Path) -> None:
    async def check(address: str) -> None:
        assert await _register(address, security.PLAINTEXT) == grpc.StatusCode.UNAVAILABLE

    _with_registry(tls(certs, "server"), check)


def test_a_tls_registry_refuses_a_client_certificate_from_another_ca(
    certs: Path, other_ca_certs: Path
) -> None:
    # The client trusts the right CA, but its own certificate comes from another one.
    foreign = security.Security(
        tls=security.TlsMaterial(
            ca=(certs / "ca.pem").read_bytes(),
            cert=(other_ca_certs / "client.pem").read_bytes(),
            key=(other_ca_certs / "client-key.pem").read_bytes(),
        )
    )

    async def check(address: str) -> None:
        assert await _register(address, foreign) == grpc.StatusCode.UNAVAILABLE
        assert await _register(address, tls(other_ca_certs, "client")) == grpc.StatusCode.UNAVAILABLE

    _with_registry(tls(certs, "server"), check)


def test_a_mutual_tls_client_registers_and_checks_health(certs: Path) -> None:
    async def check(address: str) -> None:
        assert await _register(address, tls(certs, "client")) == grpc.StatusCode.OK
        assert await _health(address, tls(certs, "client")) == health_pb2.HealthCheckResponse.SERVING

    _with_registry(tls(certs, "server"), check)


def test_mutating_rpcs_need_the_right_token_and_health_does_not() -> None:
    async def check(address: str) -> None:
        assert await _register(address, security.PLAINTEXT) == grpc.StatusCode.UNAUTHENTICATED
        wrong = token_only("not-the-token-0123456789")
        assert await _register(address, wrong) == grpc.StatusCode.UNAUTHENTICATED
        garbage = (("authorization", "Basic " + TOKEN),)
        assert await _register(address, security.PLAINTEXT, garbage) == grpc.StatusCode.UNAUTHENTICATED
        assert await _register(address, token_only(TOKEN)) == grpc.StatusCode.OK
        assert await _health(address, security.PLAINTEXT) == health_pb2.HealthCheckResponse.SERVING
        async with open_channel(address, default_deadline=5, security=security.PLAINTEXT) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            assert [e.node_id for e in (await stub.Resolve(registry_pb2.ResolveRequest())).kvstore] == [
                "kv-0"
            ]
            session = stub.Session()
            await session.write(registry_pb2.SessionRequest(open=registry_pb2.SessionOpen(node_id="kv-0")))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await session.read()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in caught.value.details()

    _with_registry(token_only(TOKEN), check)


def test_tls_and_token_together_serve_a_streaming_session(certs: Path) -> None:
    async def check(address: str) -> None:
        client = tls(certs, "client", TOKEN)
        assert await _register(address, client) == grpc.StatusCode.OK
        async with open_channel(address, default_deadline=5, security=client) as channel:
            session = registry_pb2_grpc.RegistryServiceStub(channel).Session()
            await session.write(registry_pb2.SessionRequest(open=registry_pb2.SessionOpen(node_id="kv-0")))
            await session.write(registry_pb2.SessionRequest(heartbeat=registry_pb2.Heartbeat()))
            reply = await session.read()
            assert reply.WhichOneof("body") == "ack"
            session.cancel()
        assert await _register(address, tls(certs, "client")) == grpc.StatusCode.UNAUTHENTICATED

    _with_registry(tls(certs, "server", TOKEN), check)
