"""Helpers of the registry tests: a registry process on a port of its own that can be killed and started
again on it, and waiting for it to serve."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.ports import free_port
from pcpstack.v1 import registry_pb2, registry_pb2_grpc

T = TypeVar("T")


class RegistryProcess:
    """`pcpstack serve registry` on 127.0.0.1 as a process of its own; `with` kills whatever is left."""

    def __init__(self, env: dict[str, str], *, lease_s: float = 1.0, restore_grace_s: float = 3.0) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._env = env
        self._flags = ["--lease", str(lease_s), "--restore-grace", str(restore_grace_s)]
        self._processes: list[subprocess.Popen] = []

    def start(self) -> RegistryProcess:
        """Starts a registry on the address (again, after a kill)."""
        command = [sys.executable, "-m", "pcpstack.cli", "serve", "registry", "--port", str(self.port)]
        self._processes.append(
            subprocess.Popen(
                [*command, *self._flags, "--log-level", "WARNING"],
                env=self._env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        return self

    def signal(self, number: int) -> None:
        """Sends a signal to the running registry (SIGSTOP freezes it: connections stay up, unanswered)."""
        self._processes[-1].send_signal(number)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        for process in self._processes:
            process.kill()
            process.wait()

    def __enter__(self) -> RegistryProcess:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.kill()


async def until(predicate: Callable[[], Awaitable[T]], timeout: float = 15.0) -> T:
    """Polls the coroutine function until it returns something truthy, which is returned; fails after
    timeout seconds."""
    deadline = time.monotonic() + timeout
    while not (result := await predicate()):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
    return result


async def wait_serving(address: str, timeout: float = 20.0) -> None:
    """Returns once the registry at address answers ListNodes."""
    deadline = time.monotonic() + timeout
    async with open_channel(address, default_deadline=1.0) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        while True:
            try:
                await stub.ListNodes(registry_pb2.ListNodesRequest())
                return
            except grpc.aio.AioRpcError:
                assert time.monotonic() < deadline, f"the registry at {address} did not come up"
                await asyncio.sleep(0.05)
