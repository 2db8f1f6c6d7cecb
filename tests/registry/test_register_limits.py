"""What the registry refuses of a registration on its own, over real gRPC: a carried generation that would
leave no room for new ones (it never moves the generation counter, and a snapshot holding one does not
wedge a restart), and node ids outside the allowed characters (at Register and at a node's start-up)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path

import grpc
import pytest

from pcpstack.common.channel import open_channel
from pcpstack.common.config import EngineConfig
from pcpstack.registry.assembly import Assignment
from pcpstack.registry.client import NodeSession
from pcpstack.registry.membership import (
    MAX_GENERATION,
    SNAPSHOT_VERSION,
    Membership,
    Registration,
    Settings,
    Stop,
)
from pcpstack.registry.server import start_registry
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.common.test_startup import REGISTRY, refusal

pytestmark = pytest.mark.timeout(60)
FAST = Settings(lease_s=3.0, assembly_timeout_s=5.0, restore_grace_s=0.0)
CONFIG = EngineConfig(data_parallel_size=1, nnodes=2, prefill_context_parallel_size=2, master_port=7100)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 45))


def _carrying(generation: int) -> registry_pb2.RegisterRequest:
    """A prefill node that carries a made-up assignment of the given generation."""
    return registry_pb2.RegisterRequest(
        node_id="bogus",
        role=common_pb2.NODE_ROLE_PREFILL,
        address="127.0.0.1:9099",
        device_count=1,
        engine_config=CONFIG.to_proto(),
        kv_fingerprint="fp",
        instance_id="bogus-instance",
        current_assignment=registry_pb2.Assignment(set_id="nonsense", generation=generation, nnodes=2),
    )


def _kvstore(node_id: str) -> registry_pb2.RegisterRequest:
    return registry_pb2.RegisterRequest(
        node_id=node_id, role=common_pb2.NODE_ROLE_KVSTORE, address="127.0.0.1:9600", instance_id=node_id
    )


async def _refused(stub, request: registry_pb2.RegisterRequest) -> str:
    """Registers, which must be refused with INVALID_ARGUMENT; returns the message."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Register(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value.details()


async def _pair_forms_a_set(address: str) -> registry_pb2.Assignment:
    """Two ordinary prefill nodes register; both are assigned one set, which ListSets and ListNodes show.
    Returns the master's assignment."""
    clients = [
        NodeSession(address, f"node-{i}", "prefill", f"127.0.0.1:{9000 + i}", CONFIG, "fp", device_count=1)
        for i in range(2)
    ]
    try:
        for client in clients:
            await client.start()
            await client.wait_registered(timeout=10)
        assignments = []
        for client in clients:
            command = await client.next_command(timeout=10)
            assert isinstance(command, registry_pb2.AssignCommand), command
            assignments.append(command.assignment)
        assert {a.generation for a in assignments} == {assignments[0].generation}
        async with open_channel(address, default_deadline=10.0) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            sets = (await stub.ListSets(registry_pb2.ListSetsRequest())).sets
            nodes = (await stub.ListNodes(registry_pb2.ListNodesRequest())).nodes
        assert [(s.set_id, s.generation) for s in sets if s.state != registry_pb2.SET_STATE_BROKEN] == [
            (assignments[0].set_id, assignments[0].generation)
        ]
        assert {"node-0", "node-1"} <= {n.node_id for n in nodes}
        return next(a for a in assignments if a.node_rank == 0)
    finally:
        for client in clients:
            await client.close()


def test_a_carried_generation_that_leaves_no_room_is_refused_and_sets_still_form():
    async def scenario():
        registry = await start_registry(FAST)
        try:
            async with open_channel(registry.address) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                message = await _refused(stub, _carrying(2**64 - 1))
                assert f"current_assignment.generation={2**64 - 1}" in message
                assert f"must be below {MAX_GENERATION}" in message
                # just below is still a registration (answered with Stop: the set is made up), and sets
                # formed after it count on from it, still inside the limit
                await stub.Register(_carrying(MAX_GENERATION - 1), timeout=10)
                await stub.Deregister(
                    registry_pb2.DeregisterRequest(node_id="bogus", instance_id="bogus-instance"), timeout=10
                )
            assert (await _pair_forms_a_set(registry.address)).generation == MAX_GENERATION
        finally:
            await registry.stop()

    _run(scenario())


def test_a_set_formed_after_a_refused_carried_assignment_counts_on_past_its_generation():
    # The carried generation was issued once (by an earlier registry): a new set never reuses it.
    m = Membership(FAST, 0.0)
    made_up = Assignment("nonsense", 1000, 0, 2, "10.0.0.9", 7100, False, 0, 2, (0,), ("bogus", "x"))
    config = CONFIG.validate()
    _, out = m.register(
        Registration("bogus", "prefill", "10.0.0.9:8000", 1, config, "fp", current_assignment=made_up), 0.0
    )
    assert [type(c) for _, c in out] == [Stop] and m.max_generation == 1000
    m.deregister("bogus", 0.0)
    m.register(Registration("node-0", "prefill", "10.0.0.1:8000", 1, config, "fp"), 0.0)
    assigned, _ = m.register(Registration("node-1", "prefill", "10.0.0.2:8000", 1, config, "fp"), 0.0)
    assert assigned is not None and assigned.generation == 1001


def test_a_snapshot_holding_a_generation_past_the_limit_is_clamped_with_a_log_line(tmp_path: Path, caplog):
    # what the registry stored before registrations were bounded: the raised counter and the set it formed
    wedged = Assignment(
        "default-548be3-dp0", 2**64, 0, 2, "127.0.0.1", 7100, False, 0, 2, (0,), ("gone-0", "gone-1")
    )
    path = tmp_path / "registry.snapshot"
    path.write_text(
        json.dumps(
            {
                "version": SNAPSHOT_VERSION,
                "max_generation": 2**64 - 1,
                "sets": [
                    {
                        "role": "prefill",
                        "model": "",
                        "broken": False,
                        "reason": "",
                        "assignment": {**wedged.__dict__},
                    }
                ],
            }
        )
    )

    async def scenario():
        registry = await start_registry(FAST, snapshot_path=path)
        try:
            assert (await _pair_forms_a_set(registry.address)).generation == 1
        finally:
            await registry.stop()

    with caplog.at_level(logging.WARNING, logger="pcpstack.registry.membership"):
        _run(scenario())
    messages = [r.getMessage() for r in caplog.records if r.name == "pcpstack.registry.membership"]
    assert any("max_generation is out of range" in m for m in messages), messages
    assert any("stored set dropped" in m for m in messages), messages


@pytest.mark.parametrize("node_id", ["a/b", "node 0", "node\n0", "nöde-0"])
def test_a_node_id_outside_the_allowed_characters_is_refused_naming_it(node_id: str):
    async def scenario():
        registry = await start_registry(FAST)
        try:
            async with open_channel(registry.address) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                message = await _refused(stub, _kvstore(node_id))
                assert f"node_id={node_id!r}" in message and "letters, digits" in message
                # a prefill node too, and before anything of it is checked against its peers
                prefill = _carrying(1)
                prefill.node_id = node_id
                assert (await _refused(stub, prefill)).startswith("node_id")
                listed = (await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=10)).nodes
                assert listed == []
        finally:
            await registry.stop()

    _run(scenario())


def test_overlong_strings_and_absurd_sizes_are_refused_and_resolve_keeps_answering():
    """Each string a registration carries is kept and sent in every Resolve answer: two nodes with 40 MB
    fingerprints made every Resolve fail for everybody (an answer past gRPC's size limit), and a PCP size of
    2**22 made the registry build millions of ranks on its loop."""

    async def scenario():
        registry = await start_registry(FAST)
        try:
            async with open_channel(registry.address) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                fat = _kvstore("fat-store")
                fat.kv_fingerprint = "f" * 300
                assert (await _refused(stub, fat)) == "kv_fingerprint is 300 characters; at most 256"
                long_id = _kvstore("n" * 257)
                assert (await _refused(stub, long_id)).startswith("node_id is 257 characters; at most 256")
                far = _kvstore("far-store")
                far.address = "h" * 600 + ":9600"
                assert (await _refused(stub, far)).startswith("address is 605 characters; at most 512")
                huge = _carrying(1)
                huge.node_id, huge.engine_config.prefill_context_parallel_size = "huge", 2**22
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Register(huge, timeout=10)
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # as any bad engine_config
                assert "prefill_context_parallel_size=4194304 must be at most 4096" in caught.value.details()
                await stub.Register(_kvstore("fine-store"), timeout=10)
                resolved = await stub.Resolve(registry_pb2.ResolveRequest(), timeout=10)
                assert [store.node_id for store in resolved.kvstore] == ["fine-store"]
        finally:
            await registry.stop()

    _run(scenario())


def test_the_ids_services_give_by_default_and_deployments_set_are_accepted():
    ids = [
        f"{socket.gethostname()}-kvstore-50053",  # the default of each service: hostname-role-port
        f"{socket.gethostname()}-prefill-8000",
        "ip-10-0-3-7.ec2.internal-decode-9000",
        "kvstore-0",  # compose service names
        "prefill-1",
        "pcpstack-prefill-0-1",  # pod names: StatefulSet and LeaderWorkerSet
        "pcpstack-decode-7c9d8f6b5-x2kqz",
        "node_7",
        "10.0.2.1:9100",
    ]

    async def scenario():
        registry = await start_registry(FAST)
        try:
            async with open_channel(registry.address) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                for node_id in ids:
                    answer = await stub.Register(_kvstore(node_id), timeout=10)
                    assert answer.node_id == node_id
                listed = (await stub.ListNodes(registry_pb2.ListNodesRequest(), timeout=10)).nodes
                assert sorted(n.node_id for n in listed) == sorted(ids)
        finally:
            await registry.stop()

    _run(scenario())


@pytest.mark.parametrize(
    ("service", "args"),
    [("prefill", ["--registry", REGISTRY]), ("kvstore", ["--registry", REGISTRY, "--port", "0"])],
)
def test_a_node_id_with_a_slash_is_refused_at_start_up_in_one_line(child_env, service: str, args: list[str]):
    line = refusal(child_env, service, *args, "--node-id", "rack/a")
    assert "--node-id='rack/a'" in line and "letters, digits" in line
