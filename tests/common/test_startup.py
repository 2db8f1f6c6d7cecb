"""The one start-up path: every service refuses a bad flag or config with exit status 2 and one stderr line
naming the key, the value and the rule (real `pcpstack serve` processes, refused before any model loads),
and a started service drains on SIGTERM and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pcpstack.cli.launch import service_command, spawn_service
from pcpstack.common.config import ConfigError, EngineConfig
from pcpstack.common.ports import free_port
from pcpstack.common.server import ServerOptions
from pcpstack.common.startup import Serving, serve_until_stopped
from pcpstack.prefill.main import PrefillConfig
from pcpstack.registry.main import RegistryConfig

REGISTRY = "127.0.0.1:7000"  # never dialled: every case below is refused before anything connects


def refusal(child_env: dict[str, str], service: str, *args: str, env: dict[str, str] | None = None):
    """Runs `pcpstack serve SERVICE ARGS`, which must be refused; returns its stderr lines."""
    done = subprocess.run(
        service_command(service, *args),
        capture_output=True,
        text=True,
        env={**child_env, **(env or {})},
        timeout=60,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"pcpstack serve {service}: config error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--port", "-1"], "--port=-1"),
        (["--lease", "0"], "--lease=0.0"),
        (["--restore-grace", "-2"], "--restore-grace=-2.0"),
        (["--snapshot", "/no/such/folder/registry.snapshot"], "--snapshot="),
        (["--log-level", "LOUD"], "--log-level='LOUD'"),
        (["--metrics", "nowhere"], "--metrics='nowhere'"),
    ],
)
def test_registry_refuses_a_bad_flag_with_one_line_naming_it(child_env, args: list[str], named: str) -> None:
    assert named in refusal(child_env, "registry", *args)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--port", "70000"], "--port=70000"),
        (["--capacity-bytes", "0"], "--capacity-bytes=0"),
        (["--default-lease-ms", "-5"], "--default-lease-ms=-5"),
        (["--default-lease-ms", "5000", "--max-lease-ms", "1000"], "--max-lease-ms=1000"),
        (["--shm-dir", "/no/such/folder"], "--shm-dir='/no/such/folder'"),
        (["--registry", "registry-without-port"], "--registry='registry-without-port'"),
    ],
)
def test_kvstore_refuses_a_bad_flag_with_one_line_naming_it(child_env, args: list[str], named: str) -> None:
    assert named in refusal(child_env, "kvstore", *args)


@pytest.fixture(scope="module")
def held_port():
    """A port another socket listens on, with SO_REUSEPORT as a gRPC server's: gRPC alone would bind it
    too and share it, so only the check before binding refuses it."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize(
    ("service", "args", "named"),
    [
        ("registry", ["--port", "{port}"], "--host/--port='127.0.0.1:{port}': cannot be bound"),
        ("kvstore", ["--port", "{port}"], "--host/--port='127.0.0.1:{port}': cannot be bound"),
        ("gateway", ["--port", "{port}", "--decode", REGISTRY], "--host/--port='127.0.0.1:{port}': cannot"),
        ("gateway", ["--host", "no such host", "--decode", REGISTRY], "--host/--port='no such host:"),
        (
            "registry",
            ["--port", "0", "--metrics", "127.0.0.1:{port}"],
            "--metrics='127.0.0.1:{port}': cannot",
        ),
    ],
)
def test_an_address_that_cannot_be_bound_is_refused_in_one_line(child_env, held_port, service, args, named):
    args = [arg.format(port=held_port) for arg in args]
    assert named.format(port=held_port) in refusal(child_env, service, *args)


def _prefill_config(tmp_path: Path, **engine_config: object) -> str:
    path = tmp_path / "prefill.json"
    path.write_text(json.dumps({"motor_engine_prefill_config": {"engine_config": engine_config}}))
    return str(path)


def test_prefill_refuses_a_config_file_that_breaks_a_rule(child_env, tmp_path: Path) -> None:
    config = _prefill_config(tmp_path, **{"prefill-context-parallel-size": 2, "nnodes": 3})
    line = refusal(child_env, "prefill", "--registry", REGISTRY, "--config", config)
    assert "nnodes=3" in line and "pcp" in line.lower()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--model", "/no/such/model.gguf"], "model='/no/such/model.gguf'"),
        (["--config", "/no/such/config.json"], "config='/no/such/config.json'"),
        (["--set", "master-port=0"], "master_port=0"),
        (["--set", "no-such-key=1"], "no-such-key"),
        (["--local-ranks", "2"], "--local-ranks=2"),
        (["--threads-per-rank", "0"], "--threads-per-rank=0"),
        (["--collective-timeout", "-1"], "--collective-timeout=-1.0"),
        (["--kvstore", "store"], "--kvstore='store'"),
    ],
)
def test_prefill_refuses_a_bad_flag_with_one_line_naming_it(child_env, args: list[str], named: str) -> None:
    assert named in refusal(child_env, "prefill", "--registry", REGISTRY, *args)


def test_prefill_refuses_an_unparsable_config_file(child_env, tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{ not json")
    line = refusal(child_env, "prefill", "--registry", REGISTRY, "--config", str(broken))
    assert f"config='{broken}'" in line and "valid JSON" in line


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--registry", "nowhere"], "--registry='nowhere'"),
        (["--registry", REGISTRY, "--model", "/no/such/model.gguf"], "model='/no/such/model.gguf'"),
        (["--registry", REGISTRY, "--max-batch", "0"], "--max-batch=0"),
        (["--registry", REGISTRY, "--max-requests", "0"], "--max-requests=0"),
        (["--registry", REGISTRY, "--kv-cache-tokens", "-1"], "--kv-cache-tokens=-1"),
        (["--registry", REGISTRY, "--model", "tiny", "--kv-cache-tokens", "10000000000"], "GiB of K/V cache"),
        (["--registry", REGISTRY, "--set", "prefill-context-parallel-size=2"], "parallel_size=2"),
    ],
)
def test_decode_refuses_a_bad_flag_with_one_line_naming_it(child_env, args: list[str], named: str) -> None:
    assert named in refusal(child_env, "decode", *args)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ([], "--decode and --registry"),
        (["--decode", "worker"], "--decode='worker'"),
        (["--registry", REGISTRY, "--port", "-8000"], "--port=-8000"),
        (["--registry", REGISTRY, "--request-timeout", "0"], "--request-timeout=0.0"),
    ],
)
def test_gateway_refuses_a_bad_flag_with_one_line_naming_it(child_env, args: list[str], named: str) -> None:
    assert named in refusal(child_env, "gateway", *args)


@pytest.mark.parametrize("service", ["registry", "kvstore", "gateway"])
def test_a_half_tls_environment_is_refused_naming_the_missing_settings(child_env, service: str) -> None:
    args = ["--decode", REGISTRY] if service == "gateway" else ["--port", "0"]
    line = refusal(child_env, service, *args, env={"PCPSTACK_TLS_CA": "/no/such/ca.pem"})
    assert "PCPSTACK_TLS_CA='/no/such/ca.pem'" in line and "given together" in line


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(200):
            try:
                return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)).status
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
    raise AssertionError(f"{address} never answered a health check")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_started_service_serves_health_and_exits_0_when_signalled(child_env, tmp_path: Path, sig) -> None:
    port = free_port()
    log = tmp_path / "registry.log"
    process = spawn_service("registry", ["--port", str(port)], log=log, env=child_env)
    try:
        assert asyncio.run(_health(f"127.0.0.1:{port}")) == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(sig)
        assert process.wait(timeout=30) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_service_that_stops_by_itself_is_drained_without_a_signal() -> None:
    steps: list[str] = []

    async def scenario() -> bool:
        stopped = asyncio.get_running_loop().create_future()

        async def drain() -> None:
            steps.append("drained")

        asyncio.get_running_loop().call_soon(stopped.set_result, None)
        return await serve_until_stopped(Serving(drain, stopped))

    assert asyncio.run(scenario()) is False
    assert steps == ["drained"]


def test_registry_restore_grace_defaults_to_twice_the_lease() -> None:
    assert RegistryConfig(lease=1.5).settings().restore_grace_s == 3.0
    assert RegistryConfig(lease=1.5, restore_grace=0.0).settings().restore_grace_s == 0.0


def test_an_explicit_restore_grace_holds_on_a_cold_start_with_a_new_snapshot(tmp_path: Path) -> None:
    # a cold start has no grace by default (no stored sets to wait for); one asked for is kept
    from pcpstack.registry.server import start_registry

    async def grace(config: RegistryConfig) -> float:
        registry = await start_registry(config.settings(), snapshot_path=config.snapshot)
        try:
            return registry.servicer._membership.settings.restore_grace_s
        finally:
            await registry.stop()

    snapshot = tmp_path / "registry.snapshot"
    assert asyncio.run(grace(RegistryConfig(snapshot=snapshot, restore_grace=30.0))) == 30.0
    assert asyncio.run(grace(RegistryConfig(snapshot=snapshot))) == 0.0


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: RegistryConfig(max_message_bytes=2**31), "--max-message-bytes=2147483648: must be at most"),
        (lambda: _node(advertise="0.0.0.0"), "--advertise='0.0.0.0': is no address others can dial"),
        (lambda: _node(host="0.0.0.0"), "--host='0.0.0.0': is no address others can dial"),
        (lambda: _node(advertise="a b"), "--advertise='a b': must be a host name or IP without spaces"),
        (lambda: _node(registry="::1:7000"), "must put an IPv6 host in brackets"),
        (lambda: _node(kv_lease_ms=2**32), "--kv-lease-ms=4294967296: must be at most 4294967295"),
        (
            lambda: _gateway(request_timeout=1e10),
            "--request-timeout=10000000000.0: must be at most 1,000,000",
        ),
        (lambda: _gateway(host=""), "--host='': must not be empty"),
        (lambda: _gateway(api_key=" "), "--api-key: has spaces around it"),
        (lambda: _gateway(decode=("::1:5",)), "must put an IPv6 host in brackets"),
        (lambda: RegistryConfig(advertise="registry-1"), "--advertise='registry-1': is where the other"),
        (lambda: RegistryConfig(etcd_prefix="/mine/"), "--etcd-prefix='/mine/': is where in etcd: it needs"),
        (lambda: _kvstore(node_id="store-1"), "--node-id='store-1': is what the store registers: it needs"),
        (lambda: _kvstore(advertise="store"), "--advertise='store': is what the store registers"),
    ],
)
def test_values_no_service_could_use_are_refused_naming_the_flag(build, named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        build()
    assert named in str(refused.value)


def test_a_tokenizer_folder_must_hold_a_tokenizer_and_a_model_folder_its_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"without config\.json"):
        _gateway(tokenizer=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"without tokenizer\.json"):
        _gateway(tokenizer=str(tmp_path))


def test_environment_settings_no_service_could_use_are_refused_naming_the_variable(child_env, monkeypatch):
    monkeypatch.setenv("PCPSTACK_KERNEL_MIN_SPEEDUP", "abc")
    with pytest.raises(ConfigError, match="PCPSTACK_KERNEL_MIN_SPEEDUP='abc': must be a number > 0"):
        _node()
    line = refusal(child_env, "registry", "--port", "0", env={"PCPSTACK_TRACE_FILE": "/tmp"})
    assert "PCPSTACK_TRACE_FILE='/tmp': must be a file in a folder this process can write" in line


def _kvstore(**fields):
    from pcpstack.kvstore.main import KvStoreConfig

    return KvStoreConfig(**fields)


def _node(**fields) -> PrefillConfig:
    return PrefillConfig(**{"registry": REGISTRY, "engine": EngineConfig(), **fields})


def _gateway(**fields):
    from pcpstack.gateway.main import GatewayConfig

    return GatewayConfig(**{"model_name": "tiny", "registry": REGISTRY, **fields})


def test_a_node_config_checks_the_shared_node_rules_before_its_own() -> None:
    with pytest.raises(ConfigError, match="--registry=''"):
        PrefillConfig(registry="", engine=EngineConfig(), local_ranks=-1)
    with pytest.raises(ConfigError, match="--local-ranks=-1"):
        PrefillConfig(registry=REGISTRY, engine=EngineConfig(), local_ranks=-1)


def test_server_options_refuse_a_port_out_of_range_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="port=65536"):
        ServerOptions(port=65536)
