"""The registry with its state in a real 3-member etcd cluster (`--etcd`): sets and generations survive a
registry restart, node records live under an etcd lease, a second registry writing the same state is fenced
out instead of forming overlapping sets, nodes holding their sessions with a follower are assembled and get
their commands from etcd mailboxes even after that follower's kill -9, and of two replicas one leads and the
other takes over after a kill -9 while a router-like client's reads go on without a failure. Nodes are real
NodeSession clients over gRPC on loopback. Last, a local stack with two registry replicas runs them on an
etcd of its own."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pcpstack.cli.stack import LocalStack, StackOptions
from pcpstack.cli.status import fetch, render
from pcpstack.common.channel import open_channel
from pcpstack.common.config import EngineConfig
from pcpstack.common.errors import FailedPrecondition
from pcpstack.common.ports import free_port
from pcpstack.registry.client import NodeSession, PrefillEndpoint, Resolver
from pcpstack.registry.etcd_local import EtcdCluster
from pcpstack.registry.etcd_sessions import acted_on
from pcpstack.registry.etcd_store import MAX_TXN_OPS, EtcdStore
from pcpstack.registry.membership import SNAPSHOT_VERSION, Settings
from pcpstack.registry.server import RegistryServer, start_registry
from pcpstack.v1 import registry_pb2, registry_pb2_grpc
from tests.registry.support import until, wait_serving

pytestmark = pytest.mark.timeout(90)
SETTINGS = Settings(lease_s=1.0, assembly_timeout_s=5.0, restore_grace_s=3.0)
CONFIG = EngineConfig(data_parallel_size=2, nnodes=2, prefill_context_parallel_size=2, master_port=7100)
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One 3-member etcd cluster shared by the module's tests (each keeps its state under its own prefix)."""
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


def _prefix() -> str:
    return f"/test-{next(_prefixes)}/registry/"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _start(etcd: EtcdCluster, prefix: str, elect: bool = True) -> RegistryServer:
    return await start_registry(SETTINGS, etcd_endpoints=etcd.endpoints, etcd_prefix=prefix, elect=elect)


async def _nodes(address: str, indices: range) -> list[NodeSession]:
    clients = [
        NodeSession(address, f"node-{i}", "prefill", f"127.0.0.1:{9000 + i}", CONFIG, "fp", device_count=1)
        for i in indices
    ]
    for client in clients:
        await client.start()
    return clients


async def _list_sets(address: str) -> registry_pb2.ListSetsResponse:
    # a generous deadline: on a loaded machine a registry in this process may take seconds to answer
    async with open_channel(address, default_deadline=10.0) as channel:
        return await registry_pb2_grpc.RegistryServiceStub(channel).ListSets(registry_pb2.ListSetsRequest())


async def _sets(address: str) -> list[tuple[str, int, tuple[str, ...]]]:
    reply = await _list_sets(address)
    return sorted((s.set_id, s.generation, tuple(s.member_node_ids)) for s in reply.sets)


async def _close(clients: list[NodeSession]) -> None:
    for client in clients:
        await client.close()


@pytest.mark.slow
def test_a_registry_restarted_on_etcd_awaits_the_same_sets_with_the_same_generations(etcd):
    async def scenario():
        prefix = _prefix()
        first = await _start(etcd, prefix)
        clients = await _nodes(first.address, range(4))
        store = await EtcdStore.connect(etcd.endpoints, prefix, SETTINGS.lease_s)
        try:
            for client in clients:
                await client.wait_registered(timeout=10)
            await until(lambda: _all_assigned(clients))
            formed = await _sets(first.address)
            assert len(formed) == 2 and {g for _, g, _ in formed} == {1, 2}
            # every live node has a record in etcd, under a lease the registry keeps alive
            records = await until(lambda: _records_of(store, 4))
            assert records is not None
            assert {r["address"] for r in records.values()} == {f"127.0.0.1:{9000 + i}" for i in range(4)}
            await _close(clients)
            await first.stop()
            # nobody refreshes the leases any more: the records expire with them
            await until(lambda: _no_records(store))
            second = await _start(etcd, prefix)
            try:
                await until(lambda: _leads(second))
                assert await _sets(second.address) == formed
            finally:
                await second.stop()
        finally:
            await _close(clients)
            await store.close()

    _run(scenario())


@pytest.mark.slow
def test_a_second_registry_on_the_same_etcd_state_is_fenced_out_instead_of_forming_overlapping_sets(etcd):
    async def scenario():
        prefix = _prefix()
        # two registries that both act as leader (as a paused leader whose lease ran out would): the
        # second reads the same (empty) state before the first writes
        first = await _start(etcd, prefix, elect=False)
        second = await _start(etcd, prefix, elect=False)
        ours = await _nodes(first.address, range(4))
        theirs: list[NodeSession] = []
        try:
            await until(lambda: _all_assigned(ours))
            formed = await _sets(first.address)
            theirs = await _nodes(second.address, range(4, 8))

            # the second registry's assembly is refused by etcd: its nodes never hear of a set, and it
            # answers UNAVAILABLE from then on so that nodes and routers go elsewhere (until then it may
            # list its sets as forming: they are in its core while their write to etcd is under way)
            async def refused_yet() -> bool:
                await _sets(second.address)
                return False

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await until(refused_yet, timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "another registry" in refused.value.details()
            assert all(client.assignment is None for client in theirs)
            store = await EtcdStore.connect(etcd.endpoints, prefix, SETTINGS.lease_s)
            try:
                stored = await store.load()
            finally:
                await store.close()
            assert stored is not None
            assert sorted(
                (s["assignment"]["set_id"], s["assignment"]["generation"]) for s in stored["sets"]
            ) == [(set_id, generation) for set_id, generation, _ in formed]
            assert {m for _, _, members in formed for m in members} == {f"node-{i}" for i in range(4)}
        finally:
            await _close(ours + theirs)
            await first.stop()
            await second.stop()

    _run(scenario())


@pytest.mark.slow
def test_a_change_of_more_sets_than_one_etcd_transaction_may_hold_is_written_and_read_back(etcd):
    async def scenario():
        prefix = _prefix()
        sets = [
            {"role": "prefill", "model": "", "broken": False, "reason": "", "assignment": {"set_id": f"s{i}"}}
            for i in range(MAX_TXN_OPS * 2)
        ]
        snapshot = {"version": SNAPSHOT_VERSION, "max_generation": len(sets), "sets": sets}
        writer = await EtcdStore.connect(etcd.endpoints, prefix, SETTINGS.lease_s)
        reader = await EtcdStore.connect(etcd.endpoints, prefix, SETTINGS.lease_s)
        try:
            assert await writer.load() is None
            await writer.save(snapshot)
            stored = await reader.load()
        finally:
            await writer.close()
            await reader.close()
        assert stored is not None and stored["max_generation"] == len(sets)
        assert sorted(stored["sets"], key=lambda e: int(e["assignment"]["set_id"][1:])) == sets

    _run(scenario())


async def _leads(registry: RegistryServer) -> bool:
    return registry.servicer.election is not None and registry.servicer.election.leading


async def _no_records(store: EtcdStore) -> bool:
    return not await store.node_records()


async def _all_assigned(clients: list[NodeSession]) -> bool:
    return all(client.assignment is not None for client in clients)


async def _records_of(store: EtcdStore, count: int) -> dict[str, dict] | None:
    """The node records etcd holds once there are `count` of them (an empty dict reads as reached)."""
    records = await store.node_records()
    return records if len(records) == count else None


def test_registry_flags_refuse_an_etcd_url_that_is_not_http_host_port(tmp_path: Path):
    from pcpstack.common.config import ConfigError
    from pcpstack.registry.main import RegistryConfig

    with pytest.raises(ConfigError, match="--etcd"):
        RegistryConfig(etcd="127.0.0.1:2379")
    with pytest.raises(ConfigError, match="--snapshot"):
        RegistryConfig(etcd="http://127.0.0.1:2379", snapshot=tmp_path / "s.json")


def test_a_node_is_done_with_the_commands_up_to_the_newest_it_acted_on_and_with_notices_at_once():
    def assign(generation: int) -> registry_pb2.SessionResponse:
        assignment = registry_pb2.Assignment(set_id="s", generation=generation)
        return registry_pb2.SessionResponse(assign=registry_pb2.AssignCommand(assignment=assignment))

    stop = registry_pb2.SessionResponse(stop=registry_pb2.StopCommand(set_id="s", generation=1))
    notice = registry_pb2.SessionResponse(assembly_timeout=registry_pb2.AssemblyTimeout(required=2))
    streamed = [assign(1), stop, assign(2), notice]
    # still pooled: it has not run generation 1 yet, so nothing but the notice is done
    assert acted_on(streamed[:1] + streamed[3:], 0) == [False, True]
    # it left generation 1: that assignment and its stop are done, the newer assignment is not
    assert acted_on(streamed, 0) == [True, True, False, True]
    # it runs generation 2: everything before it is superseded
    assert acted_on(streamed, 2) == [True, True, True, True]
    # it runs generation 1: the stop is not acted on yet
    assert acted_on(streamed[:2], 1) == [True, False]


def _kill(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


def _replica(etcd: EtcdCluster, prefix: str, port: int, env: dict[str, str]) -> subprocess.Popen:
    """`pcpstack serve registry --etcd ...` as a process of its own, so that it can be killed -9."""
    command = [sys.executable, "-m", "pcpstack.cli", "serve", "registry", "--port", str(port)]
    # the restore grace ends as soon as every member is back; it only bounds how long that may take
    flags = ["--lease", "2", "--restore-grace", "10", "--etcd", etcd.endpoints, "--etcd-prefix", prefix]
    return subprocess.Popen(
        [*command, *flags, "--log-level", "WARNING"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_nodes_held_by_a_follower_replica_are_assembled_and_their_pending_assign_survives_its_kill_9(
    etcd, child_env
):
    """Three replicas: the first started leads. Three nodes register and hold their sessions with a
    follower; the leader learns of them from etcd, and another process with one of their ids is refused by
    the other follower. The follower is stopped (so that it cannot deliver)
    and a fourth node registers with the leader: the sets form, the held nodes' assignments wait in
    their etcd mailboxes, and the follower is killed -9. The nodes move to the other follower, which
    streams the pending assignments from its watch; their readiness reaches the leader through etcd, one
    that falls silent is declared dead there, and one that deregisters is removed there. An unreadable
    session record in etcd stops none of this."""

    async def scenario():
        prefix = _prefix()
        ports = [free_port() for _ in range(3)]
        leader, held_by, other = (f"127.0.0.1:{port}" for port in ports)
        processes = {leader: _replica(etcd, prefix, ports[0], child_env)}
        clients: list[NodeSession] = []
        try:
            await wait_serving(leader)
            await until(lambda: _names_leader(leader))
            # a record nobody can read (a bug, a hand edit) is skipped; it stops no other node's
            store = await EtcdStore.connect(etcd.endpoints, prefix, SETTINGS.lease_s)
            await store.put_session("unreadable", b"not a record", await store.grant(60))
            await store.close()
            for address, port in ((held_by, ports[1]), (other, ports[2])):
                processes[address] = _replica(etcd, prefix, port, child_env)
            for address in (held_by, other):
                await wait_serving(address)
            clients = await _nodes(f"{held_by},{other}", range(3))
            for client in clients:
                await client.wait_registered(timeout=10)
            assert all(client.address == held_by for client in clients)
            await until(lambda: _states(leader, {registry_pb2.NODE_STATE_POOLED: 3}))
            # the id stays bound to the live session across replicas: another process is refused elsewhere
            impostor = NodeSession(other, "node-0", "prefill", "127.0.0.1:9100", CONFIG, in_use_patience_s=0)
            await impostor.start()
            with pytest.raises(FailedPrecondition, match="bound to another live session"):
                await impostor.wait_registered(timeout=10)
            await impostor.close()

            processes[held_by].send_signal(signal.SIGSTOP)
            clients += await _nodes(leader, range(3, 4))
            formed = await until(lambda: _formed(leader, 2))
            processes[held_by].kill()
            processes[held_by].wait()

            await until(lambda: _all_assigned(clients))
            assert all(client.address == other for client in clients[:3])
            pairs = sorted((set_id, generation) for set_id, generation, _ in formed)
            assert sorted({(c.assignment.set_id, c.assignment.generation) for c in clients}) == pairs
            assert await _sets(leader) == formed
            await _ready(clients)
            await until(lambda: _states(leader, {registry_pb2.NODE_STATE_READY: 4}))
            assert await _sets(leader) == formed
            # a held node that goes silent is dead at the leader, and its set leaves routing
            await clients.pop(0).close()
            dead, ready = registry_pb2.NODE_STATE_DEAD, registry_pb2.NODE_STATE_READY
            await until(lambda: _states(leader, {dead: 1, registry_pb2.NODE_STATE_POOLED: 1, ready: 2}))
            # one that deregisters through the follower is removed at the leader (not left to die)
            leaving = clients.pop(0)
            await leaving.close(deregister=True)
            await until(lambda: _lists_not(leader, leaving.node_id))
        finally:
            await _close(clients)
            _kill(list(processes.values()))

    _run(scenario())


async def _lists_not(address: str, node_id: str) -> bool:
    return node_id not in {node.node_id for node in await _list_nodes(address)}


async def _names_leader(address: str) -> bool:
    return (await _list_sets(address)).leader_address == address


async def _states(address: str, expected: dict[int, int]) -> bool:
    counts: dict[int, int] = {}
    for node in await _list_nodes(address):
        counts[node.state] = counts.get(node.state, 0) + 1
    return counts == expected


async def _formed(address: str, count: int) -> list[tuple[str, int, tuple[str, ...]]] | None:
    formed = await _sets(address)
    return formed if len(formed) == count else None


@pytest.mark.slow
def test_of_two_registry_replicas_one_leads_and_after_a_kill_9_the_other_leads_with_the_same_sets(
    etcd, child_env
):
    """Nodes and a router are given both replicas' addresses, the killed leader's first. An etcd member
    (the first endpoint, the one the registries talk to) is killed before the leader. This test runs last
    in the module: the cluster has two members from then on."""

    async def scenario():
        prefix = _prefix()
        addresses = {}
        replicas = {}
        for _ in range(2):
            port = free_port()
            addresses[port] = f"127.0.0.1:{port}"
            replicas[addresses[port]] = _replica(etcd, prefix, port, child_env)
        clients: list[NodeSession] = []
        try:
            for address in replicas:
                await wait_serving(address)
            clients = await _nodes(",".join(replicas), range(4))
            await until(lambda: _all_assigned(clients))
            await _ready(clients)
            # the readiness reaches the leader through etcd when a follower holds the nodes' sessions
            await until(lambda: _states(next(iter(replicas)), {registry_pb2.NODE_STATE_READY: 4}))
            # (No replica is asked Resolve before the kill: the follower keeps the leader's answers to both
            # questions from the first time the leader answers, and serves them while no leader answers.)
            before = {address: await _list_sets(address) for address in replicas}
            leader = before[next(iter(replicas))].leader_address
            assert leader in replicas
            # every replica answers, and names the same leader and sets
            assert len({reply.SerializeToString(deterministic=True) for reply in before.values()}) == 1
            formed = await _sets(leader)
            assignments = [(c.assignment.set_id, c.assignment.generation) for c in clients]
            (survivor,) = (address for address in replicas if address != leader)
            resolver = Resolver(f"{leader},{survivor}", ttl_s=0.0)
            answers: list = []
            failures: list[str] = []
            stop = asyncio.Event()
            stream = asyncio.create_task(_router_stream([leader, survivor], answers, failures, stop))
            while len(answers) < 4:  # the stream is under way
                await asyncio.sleep(0.05)

            etcd.kill_member(0)
            replicas[leader].kill()
            replicas[leader].wait()
            answered_before_kill = len(answers)

            async def survivor_leads_with_every_node_back():
                try:
                    reply = await _list_sets(survivor)
                    nodes = await _list_nodes(survivor)
                except grpc.aio.AioRpcError:
                    return False  # UNAVAILABLE until the lease of the killed leader runs out
                in_sets = (registry_pb2.NODE_STATE_ASSIGNED, registry_pb2.NODE_STATE_READY)
                back = len(nodes) == 4 and all(n.state in in_sets for n in nodes)
                return reply.leader_address == survivor and back

            await until(survivor_leads_with_every_node_back, timeout=20)
            stop.set()
            await stream
            # the stream of reads from a router-like client went on through the failover, none failed,
            # and every answer named the same sets with the same generations
            assert failures == [] and len(answers) > answered_before_kill
            pairs = sorted((s, g) for s, g, _ in formed)
            for answer in answers:
                if isinstance(answer, registry_pb2.ListSetsResponse):
                    assert sorted((s.set_id, s.generation) for s in answer.sets) == pairs
                else:  # Resolve: ready sets only (none while the new leader awaits the members' readiness)
                    assert {(e.set_id, e.generation) for e in answer.prefill_sets} <= set(pairs)
            assert await _sets(survivor) == formed
            assert [(c.assignment.set_id, c.assignment.generation) for c in clients] == assignments
            # the nodes re-sent their readiness: the router, its first address dead, routes to the same sets
            routed = await until(lambda: _routed(resolver, 2))
            assert sorted((e.set_id, e.generation) for e in routed) == [(s, g) for s, g, _ in formed]
            await resolver.close()
        finally:
            await _close(clients)
            _kill(list(replicas.values()))

    _run(scenario())


async def _router_stream(
    addresses: list[str], answers: list, failures: list[str], stop: asyncio.Event
) -> None:
    """A router-like client: ListSets and Resolve in turn until stop, each asked of the replicas in order
    until one answers; a call that none answers is a failure."""
    channels = [open_channel(address, default_deadline=1.0) for address in addresses]
    stubs = [registry_pb2_grpc.RegistryServiceStub(channel) for channel in channels]
    try:
        while not stop.is_set():
            for method, request in (
                ("ListSets", registry_pb2.ListSetsRequest()),
                ("Resolve", registry_pb2.ResolveRequest()),
            ):
                errors = []
                for stub in stubs:
                    try:
                        answers.append(await getattr(stub, method)(request))
                        break
                    except grpc.aio.AioRpcError as exc:
                        errors.append(f"{exc.code().name}: {exc.details()}")
                else:
                    failures.append(f"{method}: {errors}")
            await asyncio.sleep(0.05)
    finally:
        for channel in channels:
            await channel.close()


async def _ready(clients: list[NodeSession]) -> None:
    for client in clients:
        assert client.assignment is not None
        await client.report_status(client.assignment.set_id, client.assignment.generation, ready=True)


async def _routed(resolver: Resolver, count: int) -> tuple[PrefillEndpoint, ...] | None:
    sets = (await resolver.resolve(fresh=True)).prefill_sets
    return sets if len(sets) == count else None


async def _list_nodes(address: str) -> list[registry_pb2.NodeStatus]:
    async with open_channel(address, default_deadline=10.0) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return list((await stub.ListNodes(registry_pb2.ListNodesRequest())).nodes)


@pytest.mark.slow
def test_a_local_stack_with_two_registry_replicas_runs_them_on_its_own_etcd_and_status_names_the_leader(
    tmp_path: Path,
):
    # no model: the registries, their etcd and a KV store are the whole stack
    options = StackOptions(
        prefill_sets=0, decode=0, gateway=False, registry_replicas=2, log_dir=str(tmp_path)
    )

    async def scenario():
        async with LocalStack(options, progress=lambda _: None) as stack:
            services = {service.name: service for service in stack.services}
            assert {"etcd-0", "registry-0", "registry-1", "kvstore"} <= services.keys()
            assert all(service.process.poll() is None for service in services.values())
            assert len(stack.registry_addresses) == 2
            # every service is given both replicas
            assert stack.registry_address == ",".join(stack.registry_addresses)
            assert stack.registry_address in services["kvstore"].process.args
            found = await fetch(
                argparse.Namespace(registry=stack.registry_address, timeout=2.0, gateway=None, api_key="")
            )
            assert found.sets.leader_address in stack.registry_addresses
            assert f"leader: {found.sets.leader_address}" in render(found.nodes, found.sets)
            assert [node.node_id for node in found.nodes.nodes] == ["kvstore-0"]
        assert all(service.process.poll() is not None for service in stack.services)

    _run(scenario())
