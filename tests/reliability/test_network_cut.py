"""A prefill host cut off from the network: two hosts (network namespaces on a bridge) form one PCP set
(nnodes=2), then the headless host's veth is taken down.

The registry declares the silent node dead when its lease runs out, the set leaves routing, and a Prefill
sent to the set's master fails with UNAVAILABLE rather than waiting on a collective until its deadline (the
nodes run with a 5 s `--collective-timeout`). Needs root and `ip`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import grpc
import pytest

from pcpstack.common.ports import free_port
from pcpstack.prefill.client import PrefillClient
from pcpstack.v1 import common_pb2, registry_pb2
from tests.prefill.test_cross_host import ip, spawn, two_hosts, wait_for_set
from tests.reliability.support import list_nodes, list_sets, wait_until

__all__ = ["two_hosts"]  # the fixture, shared with the cross-host prefill test

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"),
]

LEASE_S = 2.0


class _Registry:
    """Just what list_nodes/list_sets need of a stack: a loop and the registry's address."""

    def __init__(self, address: str, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.stack = type("Addresses", (), {"registry_address": address})()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)


def test_cut_off_prefill_host_is_declared_dead_and_its_set_refuses_prefill(two_hosts, tmp_path) -> None:
    bridge_ip, hosts = two_hosts
    registry = f"{bridge_ip}:{free_port(bridge_ip)}"
    kvstore = f"{bridge_ip}:{free_port(bridge_ip)}"
    config = tmp_path / "prefill.json"
    engine = {"prefill-context-parallel-size": 2, "nnodes": 2, "block_size": 128, "master-port": 29512}
    engine["model"] = "tiny"
    config.write_text(json.dumps({"motor_engine_prefill_config": {"engine_config": engine}}))
    registry_args = ["--host", bridge_ip, "--port", registry.split(":")[1], "--lease", str(LEASE_S)]
    store_args = ["--port", kvstore.split(":")[1], "--registry", registry]
    procs = [
        spawn(["registry", *registry_args, "--restore-grace", "0"], tmp_path / "registry.log"),
        spawn(["kvstore", "--host", bridge_ip, *store_args], tmp_path / "kvstore.log"),
    ]
    loop = asyncio.new_event_loop()
    view = _Registry(registry, loop)
    try:
        for i, (ns, address) in enumerate(hosts):
            if i:
                # Registration order decides node_rank: host-0, the master, must be registered first.
                wait_until(
                    "host-0 to register",
                    lambda: "host-0" in {n.node_id for n in list_nodes(view)},
                    timeout=120,
                    interval=0.2,
                )
            node_args = ["--registry", registry, "--host", address, "--port", "7300"]
            node_args += ["--node-id", f"host-{i}"]
            procs.append(
                spawn(
                    [
                        "prefill",
                        *node_args,
                        "--config",
                        str(config),
                        "--kvstore",
                        kvstore,
                        "--collective-timeout",
                        "5",
                    ],
                    tmp_path / f"prefill-{i}.log",
                    netns=ns,
                )
            )
        pcp_set = loop.run_until_complete(wait_for_set(registry, 120))
        assert list(pcp_set.member_node_ids) == ["host-0", "host-1"]

        ip("link", "set", f"pcp{os.getpid() % 10000}v1", "down")  # host-1's outer veth (see two_hosts)
        cut_at = time.monotonic()

        def host1_dead() -> bool:
            nodes = {n.node_id: n.state for n in list_nodes(view)}
            return nodes.get("host-1") == registry_pb2.NODE_STATE_DEAD

        # The lease bound is checked on a controlled clock (tests/registry/test_membership.py); the time it
        # took here is printed, not asserted.
        wait_until("host-1 to be declared dead", host1_dead, timeout=30, interval=0.1)
        detected_s = time.monotonic() - cut_at
        assert all(s.state != registry_pb2.SET_STATE_READY for s in list_sets(view)), list_sets(view)

        async def prefill() -> None:
            client = PrefillClient(pcp_set.master_address)
            try:
                await client.prefill(
                    "after-cut", [1, 2, 3], common_pb2.SamplingParams(max_tokens=1, temperature=0), timeout=30
                )
            finally:
                await client.close()

        with pytest.raises(grpc.aio.AioRpcError) as info:
            loop.run_until_complete(asyncio.wait_for(prefill(), 40))
        # UNAVAILABLE, not DEADLINE_EXCEEDED at the call's 30 s: it did not wait on the collective
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        print(f"host-1 declared dead {detected_s:.2f} s after the cut (lease {LEASE_S} s)")
    finally:
        loop.close()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
