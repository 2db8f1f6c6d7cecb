"""What the fault-injection tests share: stacks with extra service flags, registry views, bounded waits,
killing and restarting services on their own addresses, and the memory of a process tree."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path

from pcpstack.cli.stack import LocalStack, Service, StackOptions
from pcpstack.common.channel import open_channel
from pcpstack.decode.client import DecodeClient, Generation, build_request
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.v1 import registry_pb2, registry_pb2_grpc
from tests.helpers import RunningStack, child_pids


class TunedStack(LocalStack):
    """A LocalStack whose services get extra command-line flags, by service name prefix ("prefill-")."""

    def __init__(self, options: StackOptions, extra_args: dict[str, list[str]]) -> None:
        super().__init__(options, progress=lambda message: None)
        self._extra_args = extra_args

    def _spawn(self, name: str, address: str, service_name: str, args: list[str]) -> Service:
        extra = [a for prefix, flags in self._extra_args.items() if name.startswith(prefix) for a in flags]
        return super()._spawn(name, address, service_name, [*args, *extra])


def start_tuned_stack(tmp: Path, extra_args: dict[str, list[str]] | None = None, **options) -> RunningStack:
    """A tiny-model stack (lease 2 s, no gateway, ready within 120 s or fail) with extra flags for some
    services, keyed by service name prefix."""
    options.setdefault("model", "tiny")
    options.setdefault("lease_s", 2.0)
    options.setdefault("gateway", False)
    options.setdefault("ready_timeout_s", 120.0)
    stack_options = StackOptions(log_dir=str(tmp), **options)
    running = RunningStack(stack_options)
    running.stack = TunedStack(stack_options, extra_args or {})
    return running.start()


def service(stack: RunningStack, name: str) -> Service:
    """The stack's service called `name` (the latest one, if it was restarted)."""
    return [s for s in stack.stack.services if s.name == name][-1]


def rank_pids(node: Service) -> list[int]:
    """The PCP rank processes of a prefill node, in start order (rank 0 first on a single-node set)."""
    ranks = []
    for pid in child_pids(node.process.pid):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
                ranks.append(pid)
    return ranks


def kill_service(stack: RunningStack, name: str) -> Service:
    """SIGKILLs a service's whole process group (a node takes its ranks with it) and reaps it."""
    victim = service(stack, name)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(victim.process.pid, signal.SIGKILL)
    victim.process.wait(timeout=30)
    return victim


def restart_service(stack: RunningStack, victim: Service) -> Service:
    """Starts a killed service again with its original command line, environment and address."""
    cmdline = list(victim.process.args)
    index = cmdline.index("serve")  # the command is launch.service_command(SERVICE, ARGS...)
    service_name, args = cmdline[index + 1], cmdline[index + 2 :]
    stack.stack.services.remove(victim)
    log_name = victim.name + "-restarted"
    # LocalStack's own _spawn: the command line already holds any extra flags.
    fresh = LocalStack._spawn(stack.stack, log_name, victim.address, service_name, args)
    fresh.name = victim.name
    return fresh


def wait_until(what: str, check: Callable[[], object], timeout: float, interval: float = 0.2) -> object:
    """Polls check() until it returns something truthy; fails naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what} (last seen: {last!r})")


async def _registry_call(address: str, method: str, request) -> object:
    async with open_channel(address, default_deadline=3) as channel:
        return await getattr(registry_pb2_grpc.RegistryServiceStub(channel), method)(request)


def list_sets(stack: RunningStack, address: str = "") -> list[registry_pb2.PcpSet]:
    """ListSets from the registry, or [] while it cannot answer."""
    try:
        reply = stack.run(
            _registry_call(
                address or stack.stack.registry_address, "ListSets", registry_pb2.ListSetsRequest()
            )
        )
    except Exception:
        return []
    return sorted(reply.sets, key=lambda s: s.set_id)


def list_nodes(stack: RunningStack, address: str = "") -> list[registry_pb2.NodeStatus]:
    """ListNodes from the registry, or [] while it cannot answer."""
    try:
        reply = stack.run(
            _registry_call(
                address or stack.stack.registry_address, "ListNodes", registry_pb2.ListNodesRequest()
            )
        )
    except Exception:
        return []
    return list(reply.nodes)


async def store_stat(address: str):
    """The KV store's Stat (counters and gauges)."""
    async with KvStoreClient(address) as store:
        return await store.stat()


def wait_store_unpinned(stack: RunningStack, timeout: float = 15.0):
    """Waits until the store holds no pinned bytes; returns its last Stat."""

    def check():
        stat = stack.run(store_stat(stack.stack.kvstore_address))
        return stat if stat.pinned_bytes == 0 else None

    return wait_until("the store to hold no pinned bytes", check, timeout)


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (VmRSS), 0 for a process that is gone."""
    total = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    for child in child_pids(pid):
        total += tree_rss_bytes(child)
    return total


async def generate(address: str, prompt: list[int], max_tokens: int = 8, timeout: float = 30.0) -> Generation:
    """One greedy answer from a decode worker; a hang past the deadline is a test failure, never a stuck
    suite."""
    client = DecodeClient(address)
    try:
        request = build_request(prompt, max_tokens=max_tokens, ignore_eos=True)
        return await asyncio.wait_for(client.generate(request, timeout=timeout), timeout + 10)
    finally:
        await client.close()


def in_thread(coroutine: Coroutine) -> concurrent.futures.Future:
    """Runs a coroutine on its own event loop in a thread, so the test can act while it is in flight."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(asyncio.run, coroutine)
    pool.shutdown(wait=False)
    return future


def signal_all(pids: list[int], signum: int) -> None:
    """Sends a signal to each process (SIGSTOP freezes, SIGCONT thaws, SIGKILL kills)."""
    for pid in pids:
        os.kill(pid, signum)


def busy_prefill_node(stack: RunningStack) -> str:
    """The prefill node that reports a job queued or running ("" while none does)."""
    return next((n.node_id for n in list_nodes(stack) if n.node_id.startswith("prefill-") and n.load > 0), "")


def wait_prefill_idle(stack: RunningStack, timeout: float = 15.0) -> None:
    """Waits until every prefill node has told the registry, in a message received after this call began,
    that it holds no request. A node's load reaches the registry only with its next heartbeat, so right
    after a request the registry may still show it; call this before sending a request that
    wait_prefill_in_flight is to find, so a finished request's load is never taken for the new one's (the
    Session stream is ordered: a load seen after a fresh idle report is a later request's)."""
    began = time.monotonic()

    def idle() -> bool:
        asked = time.monotonic()
        nodes = [
            n
            for n in list_nodes(stack)
            if n.node_id.startswith("prefill-") and n.state != registry_pb2.NODE_STATE_DEAD
        ]
        # asked - last_seen is no later than when the registry heard the node: a conservative freshness
        return bool(nodes) and all(n.load == 0 and asked - n.last_seen_ms_ago / 1000 > began for n in nodes)

    wait_until("every prefill node to report no request in flight", idle, timeout, interval=0.1)


def wait_prefill_in_flight(stack: RunningStack) -> str:
    """Waits until a prefill node reports a request queued or running; returns its node id. Only a request
    sent after wait_prefill_idle returned can be the one it finds."""
    return wait_until("a prefill node to report a request in flight", lambda: busy_prefill_node(stack), 10)
