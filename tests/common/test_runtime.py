"""The shared service runtime in real processes: health, reflection, limits, deadlines, shutdown, tracing."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.telemetry import read_span_file
from tests.common.echo_service import COUNT_METHOD, METHOD, SERVICE


@pytest.fixture
def echo_server(child_env):
    """A real Echo server process with a 1 MiB message limit and a span file."""

    def start(env_extra: dict[str, str] | None = None):
        env = {**child_env, **(env_extra or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.common.echo_service", "serve", str(1024 * 1024)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        port = int(proc.stdout.readline())
        started.append(proc)
        return proc, f"127.0.0.1:{port}"

    started: list[subprocess.Popen] = []
    yield start
    for proc in started:
        proc.kill()
        proc.wait()


async def _health(address: str) -> int:
    async with open_channel(address, default_deadline=5) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE)
        )
        return reply.status


async def _reflected_services(address: str) -> set[str]:
    async with open_channel(address, default_deadline=5) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request])):
            return {s.name for s in reply.list_services_response.service}
    return set()


def test_server_reports_serving_and_lists_its_services(echo_server) -> None:
    _, address = echo_server()
    assert asyncio.run(_health(address)) == health_pb2.HealthCheckResponse.SERVING
    services = asyncio.run(_reflected_services(address))
    assert SERVICE in services and "grpc.health.v1.Health" in services


def test_message_size_limit_is_enforced(echo_server) -> None:
    _, address = echo_server()

    async def send(size: int) -> grpc.StatusCode | None:
        async with open_channel(address, default_deadline=5) as channel:
            try:
                await channel.unary_unary(METHOD)(b"x" * size)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return None

    assert asyncio.run(send(1000)) is None
    assert asyncio.run(send(2 * 1024 * 1024)) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_channel_applies_a_default_deadline(echo_server) -> None:
    _, address = echo_server()

    async def slow_call() -> grpc.StatusCode:
        async with open_channel(address, default_deadline=0.5) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary(METHOD)(b"sleep")  # the server sleeps 10 s; no deadline is passed
            return info.value.code()

    assert asyncio.run(slow_call()) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_streams_a_client_hangs_up_on_end_without_a_logged_error(echo_server) -> None:
    # A stream abandoned mid-way used to be closed by the garbage collector in another context, where
    # resetting its tracing span's context failed: one ERROR traceback per hung-up stream.
    proc, address = echo_server({"PYTHONUNBUFFERED": "1"})

    async def hang_up() -> None:
        async with open_channel(address, default_deadline=30) as channel:
            for _ in range(5):
                call = channel.unary_stream(COUNT_METHOD)(b"100000")
                async for _ in call:
                    break
                await asyncio.sleep(0.2)  # flow control stops the server at a yield meanwhile
                call.cancel()
            await asyncio.sleep(0.5)
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(hang_up())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert "Failed to detach context" not in proc.stderr.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_server_shuts_down_gracefully_on_signal(echo_server, sig) -> None:
    proc, address = echo_server()
    assert asyncio.run(_health(address)) == health_pb2.HealthCheckResponse.SERVING
    proc.send_signal(sig)
    assert proc.wait(timeout=15) == 0
    assert proc.stdout.read().strip() == "stopped"


def test_client_and_server_spans_in_two_processes_share_a_trace(echo_server, child_env, tmp_path) -> None:
    spans_file = tmp_path / "spans.jsonl"
    proc, address = echo_server({"PCPSTACK_TRACE_FILE": str(spans_file)})
    client = subprocess.run(
        [sys.executable, "-m", "tests.common.echo_service", "call", address, "hello"],
        capture_output=True,
        text=True,
        env={**child_env, "PCPSTACK_TRACE_FILE": str(spans_file)},
        timeout=60,
    )
    assert client.returncode == 0, client.stderr
    trace_id, reply = client.stdout.split()
    assert reply == "hello"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=15)
    spans = read_span_file(spans_file)
    server_spans = [s for s in spans if s["service"] == "echo-serve" and s["kind"] == "SERVER"]
    client_spans = [s for s in spans if s["service"] == "echo-call" and s["kind"] == "CLIENT"]
    assert [s["trace_id"] for s in server_spans] == [trace_id]
    assert [s["trace_id"] for s in client_spans] == [trace_id]
    assert server_spans[0]["parent_span_id"] == client_spans[0]["span_id"]
    # Health checks made by the fixture are filtered out of traces.
    assert not [s for s in spans if "Health" in s["name"]]
