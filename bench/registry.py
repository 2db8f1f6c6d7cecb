"""Registry benchmark: assembly latency for N prefill nodes and the registry's CPU while they heartbeat.

The registry runs in its own process (`pcpstack serve registry`); N NodeSession instances run here.
Reported: the time from the last registration to the last assignment delivered, and the registry's CPU
(from /proc) while every session heartbeats once a second (lease 3 s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from pathlib import Path

from pcpstack.cli.launch import spawn_service
from pcpstack.common.channel import open_channel
from pcpstack.common.config import EngineConfig
from pcpstack.common.ports import free_port
from pcpstack.registry.client import NodeSession
from pcpstack.v1 import registry_pb2, registry_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--nodes", type=int, default=1000, help="prefill nodes (even; sets of 2)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of heartbeat load to measure")
    parser.add_argument("--lease", type=float, default=3.0, help="registry lease; heartbeats every lease/3")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_serving(address: str) -> None:
    async with open_channel(address, default_deadline=1.0) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        for _ in range(100):
            try:
                await stub.ListSets(registry_pb2.ListSetsRequest())
                return
            except Exception:
                await asyncio.sleep(0.1)
    raise RuntimeError(f"registry at {address} did not come up")


async def _measure(address: str, pid: int, nodes: int, duration: float) -> dict:
    await _wait_serving(address)
    config = EngineConfig(data_parallel_size=nodes // 2, nnodes=2, prefill_context_parallel_size=2)
    clients = [
        NodeSession(
            address, f"node-{i}", "prefill", f"127.0.0.1:{20000 + i}", config, "fp", rpc_deadline_s=30
        )
        for i in range(nodes)
    ]
    for client in clients[:-1]:
        await client.start()
    await asyncio.gather(*(c.wait_registered(timeout=120) for c in clients[:-1]))
    deadline = time.monotonic() + 120
    while not all(c.connected for c in clients[:-1]):
        if time.monotonic() > deadline:
            raise RuntimeError("not every node opened its Session within 120 s (machine overloaded?)")
        await asyncio.sleep(0.05)
    started = time.perf_counter()
    await clients[-1].start()
    await asyncio.gather(*(c.next_command(timeout=60) for c in clients))
    assembly_s = time.perf_counter() - started
    assert all(c.assignment is not None for c in clients)
    await asyncio.sleep(2.0)  # settle into the steady heartbeat rhythm
    client_cpu0, cpu0, wall0 = time.process_time(), _cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(duration)
    client_cpu1, cpu1, wall1 = time.process_time(), _cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(c.close() for c in clients))
    wall = wall1 - wall0
    return {
        "nodes": nodes,
        "sets": nodes // 2,
        "assembly_s": round(assembly_s, 3),
        "heartbeat_window_s": round(wall, 1),
        "registry_cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / wall, 1),
        "clients_cpu_pct_of_one_core": round(100 * (client_cpu1 - client_cpu0) / wall, 1),
        "targets": {"assembly_s": "< 1", "registry_cpu_pct_of_one_core": "< 25"},
    }


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark and returns its numbers."""
    if args.nodes < 2 or args.nodes % 2:
        raise SystemExit(f"--nodes={args.nodes} must be an even number >= 2")
    port = free_port()
    registry = spawn_service(
        "registry",
        [
            *("--port", str(port), "--lease", str(args.lease), "--restore-grace", "0"),
            *("--assembly-timeout", "600", "--log-level", "WARNING"),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        return asyncio.run(_measure(f"127.0.0.1:{port}", registry.pid, args.nodes, args.duration))
    finally:
        registry.terminate()
        registry.wait(timeout=10)
