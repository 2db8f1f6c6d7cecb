"""Request bytes that are not a valid protobuf message, sent to real service processes: every kind of method
(unary, server streaming, bidirectional) answers INVALID_ARGUMENT naming the method, never UNKNOWN, and the
service goes on serving well-formed calls."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pcpstack.cli.launch import spawn_service
from pcpstack.common.ports import free_port
from pcpstack.v1 import registry_pb2, registry_pb2_grpc

# A length-delimited field 1 that claims 5 bytes and has 2: no protobuf decoder accepts it.
TRUNCATED = b"\x0a\x05ab"
# A string field (tag 1, wire type 2) holding invalid UTF-8, which proto3 refuses.
BAD_UTF8 = b"\x0a\x02\xff\xfe"


def _wait_serving(address: str, process: subprocess.Popen, log: Path) -> None:
    async def check() -> bool:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
            except grpc.aio.AioRpcError:
                return False
            return answer.status == health_pb2.HealthCheckResponse.SERVING

    for _ in range(300):
        if process.poll() is not None:
            raise RuntimeError(f"the service exited:\n{log.read_text()[-3000:]}")
        if asyncio.run(check()):
            return
        asyncio.run(asyncio.sleep(0.2))
    raise RuntimeError(f"{address} did not serve")


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A registry and a KV store, each its own process; yields their addresses by name."""
    folder = tmp_path_factory.mktemp("decoding")
    addresses, processes = {}, []
    try:
        for name, extra in (("registry", []), ("kvstore", ["--capacity-bytes", str(1 << 20)])):
            port = free_port()
            log = folder / f"{name}.log"
            process = spawn_service(name, ["--port", str(port), *extra], log=log)
            processes.append(process)
            addresses[name] = f"127.0.0.1:{port}"
            _wait_serving(addresses[name], process, log)
        yield addresses
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=15)


async def _raw_call(address: str, method: str, streaming: tuple[bool, bool], body: bytes) -> grpc.aio.Call:
    """Sends body unchanged (no serializer) and returns the finished call."""
    async with grpc.aio.insecure_channel(address) as channel:
        kinds = {
            (False, False): channel.unary_unary,
            (False, True): channel.unary_stream,
            (True, True): channel.stream_stream,
        }
        call_kind = kinds[streaming](method)
        if streaming[0]:
            call = call_kind(timeout=10)
            try:
                await call.write(body)
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the server may end the call before the client finishes writing
        else:
            call = call_kind(body, timeout=10)
        try:
            if streaming[1]:
                async for _ in call:
                    pass
            else:
                await call
        except grpc.aio.AioRpcError:
            pass
        return call


@pytest.mark.parametrize("body", [TRUNCATED, BAD_UTF8], ids=["truncated", "bad-utf8"])
@pytest.mark.parametrize(
    ("service", "method", "streaming"),
    [
        ("registry", "/pcpstack.v1.RegistryService/Resolve", (False, False)),
        ("registry", "/pcpstack.v1.RegistryService/Register", (False, False)),
        ("registry", "/pcpstack.v1.RegistryService/Session", (True, True)),
        ("registry", "/grpc.health.v1.Health/Watch", (False, True)),
        ("kvstore", "/pcpstack.v1.KvStoreService/Put", (True, True)),
        ("kvstore", "/pcpstack.v1.KvStoreService/Stat", (False, False)),
    ],
)
def test_a_request_that_does_not_decode_is_invalid_argument_naming_the_method(
    services, service: str, method: str, streaming: tuple[bool, bool], body: bytes
) -> None:
    async def scenario() -> tuple[grpc.StatusCode, str]:
        call = await _raw_call(services[service], method, streaming, body)
        return await call.code(), await call.details()

    code, details = asyncio.run(scenario())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert method in details and "not a valid message" in details


def test_the_service_still_serves_after_malformed_requests(services) -> None:
    async def scenario() -> registry_pb2.ResolveResponse:
        resolve = "/pcpstack.v1.RegistryService/Resolve"
        await _raw_call(services["registry"], resolve, (False, False), TRUNCATED)
        async with grpc.aio.insecure_channel(services["registry"]) as channel:
            return await registry_pb2_grpc.RegistryServiceStub(channel).Resolve(
                registry_pb2.ResolveRequest(), timeout=10
            )

    assert isinstance(asyncio.run(scenario()), registry_pb2.ResolveResponse)
