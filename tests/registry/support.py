"""Helpers of the registry tests: a registry process on a chosen port, and waiting for it to serve."""

from __future__ import annotations

import asyncio
import subprocess
import time

import grpc

from pcpstack.cli.launch import spawn_service
from pcpstack.common.channel import open_channel
from pcpstack.v1 import registry_pb2, registry_pb2_grpc


def spawn_registry(port: int, env: dict[str, str], *, lease_s: float = 1.0, restore_grace_s: float = 3.0):
    """`pcpstack serve registry` on 127.0.0.1:port, as a process of its own."""
    return spawn_service(
        "registry",
        [
            *("--port", str(port), "--lease", str(lease_s)),
            *("--restore-grace", str(restore_grace_s), "--log-level", "WARNING"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


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
