"""Fixtures for the gateway's live tests: gateway processes in front of real stacks, and openai clients."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pcpstack.cli.launch import child_env, spawn_service
from pcpstack.common.ports import free_port
from pcpstack.common.telemetry import read_span_file
from tests.helpers import RunningStack, start_stack


def child_environment(trace_file: Path | None = None) -> dict[str, str]:
    """The environment of a service process: unbuffered, telemetry off but spans to trace_file if given."""
    return child_env(inherit_telemetry=False, trace_file=trace_file)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """Status and body of a GET (error statuses included)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class GatewayProcess:
    """A gateway process; `url` is its base URL (…/v1 is the OpenAI base)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process = spawn_service("gateway", ["--port", str(self.port), *args], log=log_path, env=env)

    def wait_healthy(self, timeout: float = 120.0) -> GatewayProcess:
        """Waits until /health answers 200 (a decode worker is serving)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if http_get(f"{self.url}/health", timeout=3)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the gateway was not healthy after {timeout:.0f} s")

    def wait_listening(self, timeout: float = 60.0) -> GatewayProcess:
        """Waits until the HTTP server answers /v1/models (whether or not any decode worker serves)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if http_get(f"{self.url}/v1/models", timeout=3)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the gateway did not listen within {timeout:.0f} s")

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        """An openai client for this gateway that never retries (so a 503 is seen as it is)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=300)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ServiceProcesses:
    """A few `pcpstack serve ...` processes started by hand, for stacks LocalStack would wait on forever."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir, self.env = log_dir, env
        self.processes: list[subprocess.Popen] = []

    def spawn(self, name: str, args: list[str]) -> None:
        """Starts `pcpstack serve ARGS` (ARGS begins with the service) logging to LOG_DIR/NAME.log."""
        service, *flags = args
        self.processes.append(spawn_service(service, flags, log=self.log_dir / f"{name}.log", env=self.env))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory) -> Iterator[tuple[RunningStack, Path]]:
    """A SmolLM2 stack (PCP=2) whose services write their spans to a file; yields (stack, span file)."""
    folder = tmp_path_factory.mktemp("gateway-stack")
    trace_file = folder / "spans.jsonl"
    stack = start_stack(folder, pcp=2, trace_file=str(trace_file))
    yield stack, trace_file
    stack.stop()


@pytest.fixture(scope="module")
def gateway(traced_stack) -> Iterator[GatewayProcess]:
    """A gateway in front of the traced stack's decode worker, writing spans to the same file."""
    stack, trace_file = traced_stack
    folder = trace_file.parent
    process = GatewayProcess(
        ["--decode", stack.decode], folder / "gateway.log", child_environment(trace_file)
    )
    try:
        yield process.wait_healthy()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def gateway_alone(tmp_path_factory) -> Iterator[GatewayProcess]:
    """A gateway process whose only decode worker address has nobody listening: what it refuses by itself
    it answers with a 400, anything it would pass on with a 503."""
    folder = tmp_path_factory.mktemp("gateway-alone")
    process = GatewayProcess(
        ["--decode", f"127.0.0.1:{free_port()}"], folder / "gateway.log", child_environment()
    )
    try:
        yield process.wait_listening()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def gateway_without_prefill(tmp_path_factory) -> Iterator[GatewayProcess]:
    """A gateway finding, through a registry, a decode worker (tiny model) that has no prefill set at all."""
    folder = tmp_path_factory.mktemp("gateway-no-prefill")
    env = child_environment()
    services = ServiceProcesses(folder, env)
    registry = f"127.0.0.1:{free_port()}"
    services.spawn(
        "registry", ["registry", "--port", registry.split(":")[1], "--lease", "2", "--restore-grace", "0"]
    )
    services.spawn(
        "decode",
        [
            "decode",
            "--registry",
            registry,
            "--port",
            str(free_port()),
            "--model",
            "tiny",
            "--node-id",
            "decode-0",
        ],
    )
    process = GatewayProcess(["--registry", registry, "--model-name", "tiny"], folder / "gateway.log", env)
    try:
        yield process.wait_healthy()
    finally:
        process.stop()
        services.stop()


API_KEY = "test-key-0123456789abcdef"
ALLOWED_ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory) -> Iterator[RunningStack]:
    """A tiny-model stack with two decode workers, each serving Prometheus metrics."""
    stack = start_stack(tmp_path_factory.mktemp("tiny-stack"), pcp=2, decode=2, model="tiny", metrics=True)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def guarded_gateway(tiny_stack, tmp_path_factory) -> Iterator[GatewayProcess]:
    """A gateway with an API key (from a file) and one allowed CORS origin, in front of the tiny stack's two
    decode workers, the first address in its list a dead one."""
    folder = tmp_path_factory.mktemp("guarded-gateway")
    key_file = folder / "api-key"
    key_file.write_text(API_KEY + "\n")
    dead = f"127.0.0.1:{free_port()}"
    workers = ",".join([dead, *tiny_stack.stack.decode_addresses])
    args = ["--decode", workers, "--model-name", "tiny", "--api-key-file", str(key_file)]
    args += ["--allowed-origins", ALLOWED_ORIGIN]
    process = GatewayProcess(args, folder / "gateway.log", child_environment())
    try:
        yield process.wait_healthy()
    finally:
        process.stop()


def spans_of_trace(trace_file: Path, trace_id: str, services: set[str], timeout: float = 10.0) -> list[dict]:
    """The spans of one trace, waiting until each of `services` wrote at least one."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in read_span_file(trace_file) if s["trace_id"] == trace_id]
        if services <= {s["service"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)
