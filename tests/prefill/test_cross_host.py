"""Two prefill nodes on two hosts (network namespaces joined by veth to a bridge) form one TP x PCP set.

Each node has its own address; the registry assembles them (nnodes=2, PCP=2, TP=3: each node runs the three
TP ranks of one PCP rank), they join one world of gloo groups across the hosts (the TP groups inside a host,
the PCP groups across), and the set's result, its replica stored as one object per K/V head, equals
single-rank prefill. Needs root and `ip`. A small random model with SmolLM2's head layout (9 query heads,
3 K/V heads) keeps it short; SmolLM2 itself at TP=3 x PCP=2 is checked in-process in test_tp_exact.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import torch

from pcpstack.cli.launch import spawn_service
from pcpstack.common.channel import open_channel
from pcpstack.common.ports import free_port
from pcpstack.engine.engine import Engine
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.prefill.client import PrefillClient
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.helpers import small_hf_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"),
]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """A bridge on this host (x.1) and two namespaces (x.2, x.3) on it; yields (bridge_ip, [(ns, ip)])."""
    tag = f"{os.getpid() % 10000}"
    subnet = f"198.18.{random.randint(1, 250)}"
    bridge = f"pcpbr{tag}"
    hosts = [(f"pcp{tag}h{i}", f"{subnet}.{i + 2}") for i in range(2)]
    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i, (ns, address) in enumerate(hosts):
            outer, inner = f"pcp{tag}v{i}", f"pcp{tag}p{i}"
            ip("netns", "add", ns)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "master", bridge)
            ip("link", "set", outer, "up")
            ip("netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", inner)
            ip("netns", "exec", ns, "ip", "link", "set", inner, "up")
            ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield f"{subnet}.1", hosts
    finally:
        for ns, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)


def spawn(args: list[str], log: Path, netns: str | None = None) -> subprocess.Popen:
    """Starts `pcpstack serve ARGS` (ARGS begins with the service), inside network namespace netns if
    given, in a session of its own."""
    service, *flags = args
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return spawn_service(service, flags, log=log, prefix=prefix, start_new_session=True)


async def wait_for_set(registry: str, timeout: float) -> registry_pb2.PcpSet:
    deadline = time.monotonic() + timeout
    async with open_channel(registry, default_deadline=5) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                sets = (await stub.ListSets(registry_pb2.ListSetsRequest())).sets
            except Exception:
                sets = []
            if sets and sets[0].state == registry_pb2.SET_STATE_READY:
                return sets[0]
            await asyncio.sleep(0.5)
    raise TimeoutError("no ready set")


async def wait_for_node(registry: str, node_id: str, timeout: float) -> None:
    """Returns once the registry lists node_id (it has registered)."""
    deadline = time.monotonic() + timeout
    async with open_channel(registry, default_deadline=5) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                nodes = (await stub.ListNodes(registry_pb2.ListNodesRequest())).nodes
            except grpc.aio.AioRpcError:
                nodes = []
            if any(n.node_id == node_id for n in nodes):
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{node_id} did not register")


def small_gqa_model(folder: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's head layout (3 K/V heads, 3 query heads each), so TP=3 splits it
    the way it splits SmolLM2, at a size that loads in a moment."""
    small_hf_llama(folder, heads=9, kv_heads=3, head_dim=16, layers=2)
    return folder


def test_two_hosts_form_one_tp3_pcp2_set_and_prefill_exactly(two_hosts, tmp_path) -> None:
    """The issue's shape scaled down: TP=3 x PCP=2 over nnodes=2, three rank processes per host."""
    bridge_ip, hosts = two_hosts
    model = small_gqa_model(tmp_path / "model")
    registry = f"{bridge_ip}:{free_port(bridge_ip)}"
    kvstore = f"{bridge_ip}:{free_port(bridge_ip)}"
    config = tmp_path / "prefill.json"
    config.write_text(
        json.dumps(
            {
                "motor_engine_prefill_config": {
                    "engine_config": {
                        "prefill-context-parallel-size": 2,
                        "tensor_parallel_size": 3,
                        "nnodes": 2,
                        "block_size": 128,
                        "master-port": 29511,
                        "model": str(model),
                    }
                }
            }
        )
    )
    procs = [
        spawn(
            [
                "registry",
                "--host",
                bridge_ip,
                "--port",
                registry.split(":")[1],
                "--lease",
                "2",
                "--restore-grace",
                "0",
            ],
            tmp_path / "registry.log",
        ),
        spawn(
            [
                "kvstore",
                "--host",
                bridge_ip,
                "--port",
                kvstore.split(":")[1],
                "--registry",
                registry,
            ],
            tmp_path / "kvstore.log",
        ),
    ]
    loop = asyncio.new_event_loop()
    for i, (ns, address) in enumerate(hosts):
        # Registration order decides node_rank: the second host starts once the first is registered.
        if i:
            loop.run_until_complete(wait_for_node(registry, "host-0", 120))
        procs.append(
            spawn(
                [
                    "prefill",
                    "--registry",
                    registry,
                    "--host",
                    address,
                    "--port",
                    "7300",
                    "--node-id",
                    f"host-{i}",
                    "--config",
                    str(config),
                    "--kvstore",
                    kvstore,
                ],
                tmp_path / f"prefill-{i}.log",
                netns=ns,
            )
        )
    try:
        pcp_set = loop.run_until_complete(wait_for_set(registry, 120))
        assert list(pcp_set.member_node_ids) == ["host-0", "host-1"]
        assert pcp_set.master_address == f"{hosts[0][1]}:7300"

        async def prefill(ids: list[int]):
            client = PrefillClient(pcp_set.master_address)
            try:
                reply = await client.prefill(
                    "cross-host", ids, common_pb2.SamplingParams(max_tokens=1, temperature=0), timeout=60
                )
            finally:
                await client.close()
            shards = []
            async with KvStoreClient(reply.kv.store_address, prefer_shm=False) as store:
                for shard in reply.kv.shards:
                    data, _ = await store.get(shard.key, shard.fingerprint, shard.capability)
                    heads = shard.kv_head_end - shard.kv_head_start
                    kv = torch.frombuffer(bytearray(data), dtype=torch.float32)
                    layout = reply.kv.layout
                    shards.append(kv.view(layout.num_layers, 2, len(ids), heads, layout.head_dim))
            # placed by head range: the whole replica
            return reply, torch.cat(shards, dim=3)

        ids = torch.randint(0, 256, (77,), generator=torch.Generator().manual_seed(1)).tolist()
        reply, kv = loop.run_until_complete(prefill(ids))
        reference = Engine.load(str(model), device="cpu", dtype=torch.float32, block_size=128)
        logits = reference.prefill("ref", ids)
        expected = reference.export_sequence("ref")
        assert reply.first_token_id == int(logits.argmax())
        assert (reply.pcp_size, reply.kv.source_tp_size) == (2, 3)
        assert [(s.kv_head_start, s.kv_head_end) for s in reply.kv.shards] == [(0, 1), (1, 2), (2, 3)]
        assert (kv - expected).abs().max().item() <= 1e-4
    finally:
        loop.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
