"""Bad security settings are refused naming the rule; the registry refuses advertised hosts that are not the
node's own; settings reach child processes through the environment."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from pcpstack.cli.launch import service_command
from pcpstack.common import security
from pcpstack.common.channel import open_channel
from pcpstack.common.server import ServerOptions
from pcpstack.registry.membership import Settings
from pcpstack.registry.server import start_registry
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.conftest import ROOT
from tests.security.conftest import TOKEN, tls

FAST = Settings(lease_s=2.0, assembly_timeout_s=5.0, restore_grace_s=0.0)


def _settings(folder: Path, cert: str = "server", key: str = "server-key", ca: Path | None = None):
    return security.SecuritySettings(
        ca_file=str(ca or folder / "ca.pem"),
        cert_file=str(folder / f"{cert}.pem"),
        key_file=str(folder / f"{key}.pem"),
    )


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (lambda s, o: security.SecuritySettings(ca_file=s.ca_file), "given together"),
        (lambda s, o: _settings(Path(s.ca_file).parent, key="client-key"), "must belong together"),
        (lambda s, o: _settings(Path(s.ca_file).parent, ca=o / "ca.pem"), "not issued by"),
        (
            lambda s, o: security.SecuritySettings(s.ca_file, s.ca_file + ".missing", s.key_file),
            "cannot be read",
        ),
        (lambda s, o: security.SecuritySettings(s.ca_file, s.key_file, s.key_file), "PEM certificate"),
        (lambda s, o: security.SecuritySettings(token="short"), "at least 16"),
        (lambda s, o: security.SecuritySettings(token=TOKEN + " x"), "without spaces"),
        (lambda s, o: security.SecuritySettings(token=TOKEN, token_file=s.ca_file), "one way"),
    ],
)
def test_bad_security_settings_are_refused_naming_the_rule(
    certs: Path, other_ca_certs: Path, change, rule
) -> None:
    with pytest.raises(security.SecurityConfigError, match=rule):
        security.load(change(_settings(certs), other_ca_certs))


def test_a_service_started_with_half_a_tls_config_exits_naming_the_rule(certs: Path, child_env) -> None:
    done = subprocess.run(
        service_command("registry", "--port", "0", "--tls-ca", str(certs / "ca.pem")),
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "PCPSTACK_TLS_CERT" in done.stderr and "given together" in done.stderr


def test_configure_exports_settings_for_child_processes(certs: Path, tmp_path: Path, monkeypatch) -> None:
    for name in security.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    settings = security.SecuritySettings(**{**vars(_settings(certs)), "token_file": str(token_file)})
    try:
        security.configure(security.load(settings))
        assert os.environ[security.CA_ENV] == str(certs / "ca.pem")
        assert os.environ[security.TOKEN_FILE_ENV] == str(token_file)
        assert security.TOKEN_ENV not in os.environ  # a token from a file travels as its path
        inherited = security.from_env()
        assert inherited.token == TOKEN and inherited.tls == security.current().tls
    finally:
        security.configure(None)


def test_peer_ip_reads_grpc_peer_strings() -> None:
    assert security.peer_ip("ipv4:127.0.0.1:5000") == ipaddress.ip_address("127.0.0.1")
    assert security.peer_ip("ipv6:[::1]:5000") == ipaddress.ip_address("::1")
    assert security.peer_ip("ipv6:[::ffff:10.0.0.2]:5000") == ipaddress.ip_address("10.0.0.2")
    assert security.peer_ip("unix:/tmp/socket") is None


async def _register(
    address: str, advertised: str, dist_host: str = "", channel_security=None
) -> grpc.StatusCode:
    request = registry_pb2.RegisterRequest(
        node_id="kv-0", role=common_pb2.NODE_ROLE_KVSTORE, address=advertised, dist_host=dist_host
    )
    async with open_channel(address, default_deadline=5, security=channel_security) as channel:
        try:
            await registry_pb2_grpc.RegistryServiceStub(channel).Register(request)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                assert "address" in exc.details(), exc.details()  # a refusal says which address was wrong
            return exc.code()
        return grpc.StatusCode.OK


def test_a_node_may_only_advertise_its_own_host() -> None:
    async def scenario():
        registry = await start_registry(FAST, ServerOptions(security=security.PLAINTEXT))
        lax = await start_registry(
            FAST, ServerOptions(security=security.PLAINTEXT), verify_peer_address=False
        )
        try:
            address = registry.address
            assert await _register(address, "127.0.0.5:9600") == grpc.StatusCode.OK
            assert await _register(address, "localhost:9600") == grpc.StatusCode.OK
            assert await _register(address, "10.1.2.3:9600") == grpc.StatusCode.PERMISSION_DENIED
            assert await _register(address, "0.0.0.0:9600") == grpc.StatusCode.PERMISSION_DENIED
            assert await _register(address, "no-such-host.invalid:9600") == grpc.StatusCode.PERMISSION_DENIED
            assert await _register(address, "127.0.0.1:9600", "10.1.2.3") == grpc.StatusCode.PERMISSION_DENIED
            assert await _register(address, "127.0.0.1:notaport") == grpc.StatusCode.INVALID_ARGUMENT
            assert await _register(lax.address, "10.1.2.3:9600") == grpc.StatusCode.OK
        finally:
            await registry.stop(grace=0)
            await lax.stop(grace=0)

    asyncio.run(scenario())


def test_the_refusal_names_the_field_and_the_rule() -> None:
    async def scenario():
        registry = await start_registry(FAST, ServerOptions(security=security.PLAINTEXT))
        try:
            request = registry_pb2.RegisterRequest(
                node_id="p-0", role=common_pb2.NODE_ROLE_KVSTORE, address="127.0.0.1:1", dist_host="192.0.2.7"
            )
            async with open_channel(
                registry.address, default_deadline=5, security=security.PLAINTEXT
            ) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await registry_pb2_grpc.RegistryServiceStub(channel).Register(request)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "dist_host='192.0.2.7'" in caught.value.details()
            assert "--verify-peer-address" in caught.value.details()
        finally:
            await registry.stop(grace=0)

    asyncio.run(scenario())


def test_a_host_the_node_certificate_names_may_be_advertised(tmp_path: Path) -> None:
    from pcpstack.cli.certs import write_certs

    write_certs(tmp_path, names=["server", "node"], ips=["127.0.0.1", "192.0.2.9"])

    async def scenario():
        registry = await start_registry(FAST, ServerOptions(security=tls(tmp_path, "server")))
        try:
            node = tls(tmp_path, "node")
            assert (
                await _register(registry.address, "192.0.2.9:9600", channel_security=node)
                == grpc.StatusCode.OK
            )
            assert (
                await _register(registry.address, "192.0.2.10:9600", channel_security=node)
                == grpc.StatusCode.PERMISSION_DENIED
            )
        finally:
            await registry.stop(grace=0)

    asyncio.run(scenario())
