"""The registry over real gRPC on loopback, with real NodeSession and Resolver instances: assignment,
readiness, errors, eviction and re-forming, fencing, node ids bound to their sessions, and a registry
process killed and restarted."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import grpc
import pytest

from pcpstack.common.channel import open_channel
from pcpstack.common.config import EngineConfig
from pcpstack.common.errors import FailedPrecondition, Unavailable
from pcpstack.registry.client import NodeSession, Resolver
from pcpstack.registry.membership import Membership, NodeState, Registration, Settings
from pcpstack.registry.resolver import CACHED_WAIT_S
from pcpstack.registry.server import RegistryServicer, start_registry
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.registry.support import RegistryProcess, until

pytestmark = pytest.mark.timeout(60)
FAST = Settings(lease_s=0.6, assembly_timeout_s=0.5, restore_grace_s=0.0)
CONFIG = EngineConfig(data_parallel_size=2, nnodes=2, prefill_context_parallel_size=2, master_port=7100)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 45))


def _client(address: str, index: int, config: EngineConfig = CONFIG, **kwargs) -> NodeSession:
    return NodeSession(
        address,
        f"node-{index}",
        "prefill",
        f"127.0.0.1:{9000 + index}",
        config,
        "fp",
        device_count=1,
        **kwargs,
    )


async def _assigned(clients: list[NodeSession]) -> list[registry_pb2.Assignment]:
    assignments = []
    for client in clients:
        command = await client.next_command(timeout=5)
        assert isinstance(command, registry_pb2.AssignCommand), command
        assignments.append(command.assignment)
    return assignments


async def _started(address: str, indices, **kwargs) -> list[NodeSession]:
    clients = [_client(address, i, **kwargs) for i in indices]
    for client in clients:
        await client.start()
        await client.wait_registered(timeout=5)
    return clients


async def _ready(clients: list[NodeSession]) -> None:
    for client in clients:
        a = client.assignment
        await client.report_status(a.set_id, a.generation, ready=True)


def test_nodes_get_assignments_and_sets_become_routable_once_ready(child_env):
    async def scenario():
        registry = await start_registry(FAST)
        clients = await _started(registry.address, range(4))
        resolver = Resolver(registry.address)
        try:
            assignments = await _assigned(clients)
            assert [(a.dp_rank, a.node_rank, a.headless) for a in assignments] == [
                (0, 0, False),
                (0, 1, True),
                (1, 0, False),
                (1, 1, True),
            ]
            assert assignments[1].master_addr == "127.0.0.1" and assignments[1].master_port == 7100
            assert list(assignments[3].pcp_ranks) == [1]
            assert (await resolver.resolve()).prefill_sets == ()
            await _ready(clients)

            async def both_sets() -> list[registry_pb2.PrefillSetEndpoint]:
                sets = await _resolved_sets(registry.address)
                return sets if len(sets) == 2 else []

            found = await until(both_sets)
            assert sorted(e.address for e in found) == ["127.0.0.1:9000", "127.0.0.1:9002"]
            # `pcpstack status`, as a process: nodes, sets and the routing the resolver is given
            status = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "pcpstack.cli",
                "status",
                "--registry",
                registry.address,
                stdout=asyncio.subprocess.PIPE,
                env=child_env,
            )
            table = (await status.communicate())[0].decode()
            assert status.returncode == 0 and "node-3" in table and table.count("ready") >= 6
            routing = table.split("ROUTING", 1)[1]
            prefill_row = next(line for line in routing.splitlines() if line.startswith("prefill"))
            assert "127.0.0.1:9000" in prefill_row and "127.0.0.1:9002" in prefill_row
        finally:
            for client in clients:
                await client.close()
            await resolver.close()
            await registry.stop()

    _run(scenario())


async def _resolved_sets(address: str) -> list[registry_pb2.PrefillSetEndpoint]:
    """The registry's own answer now (no client cache): ready sets; none while it is unreachable."""
    async with open_channel(address, default_deadline=2.0) as channel:
        try:
            answer = await registry_pb2_grpc.RegistryServiceStub(channel).Resolve(
                registry_pb2.ResolveRequest()
            )
        except grpc.aio.AioRpcError:
            return []
    return list(answer.prefill_sets)


def test_bad_registrations_are_refused_with_the_right_code():
    async def scenario():
        registry = await start_registry(FAST)
        try:
            async with open_channel(registry.address) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Register(
                        registry_pb2.RegisterRequest(role=common_pb2.NODE_ROLE_KVSTORE, address="h:1")
                    )
                assert (
                    caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    and "node_id" in caught.value.details()
                )
                bad_decode = registry_pb2.RegisterRequest(
                    node_id="d",
                    role=common_pb2.NODE_ROLE_DECODE,
                    address="h:1",
                    engine_config=common_pb2.EngineConfig(prefill_context_parallel_size=2),
                )
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Register(bad_decode)
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "prefill_context_parallel_size" in caught.value.details()
                call = stub.Session(timeout=5)
                await call.write(registry_pb2.SessionRequest(open=registry_pb2.SessionOpen(node_id="ghost")))
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call.read()
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            (first,) = await _started(registry.address, [0])
            mismatched = _client(registry.address, 1, config=EngineConfig(data_parallel_size=2, nnodes=1))
            await mismatched.start()
            with pytest.raises(FailedPrecondition, match=r"nnodes=1 \(peers: 2\)"):
                await mismatched.wait_registered(timeout=5)
            await mismatched.close()
            await first.close()
        finally:
            await registry.stop()

    _run(scenario())


def test_a_silent_member_is_evicted_its_set_stopped_and_reformed_with_a_new_generation():
    async def scenario():
        registry = await start_registry(FAST)
        clients = await _started(registry.address, range(4))
        try:
            assignments = await _assigned(clients)
            await _ready(clients)
            await clients[1].close()  # no deregistration: it just goes silent
            stop = await clients[0].next_command(timeout=5)
            assert isinstance(stop, registry_pb2.StopCommand) and "node-1 missed its lease" in stop.reason
            assert clients[0].assignment is None
            found = await until(lambda: _resolved_sets(registry.address))
            assert [e.set_id for e in found] == [assignments[2].set_id]
            (late,) = await _started(registry.address, [4])
            reformed = (await _assigned([clients[0]]))[0]
            assert reformed.set_id == assignments[0].set_id
            assert reformed.generation > max(a.generation for a in assignments)
            assert list(reformed.member_node_ids) == ["node-0", "node-4"]
            assert late.assignment == registry_pb2.Assignment(
                **{
                    **_fields(reformed),
                    "node_rank": 1,
                    "headless": True,
                    "pcp_ranks": [1],
                    "global_ranks": [1],
                }
            )
            await late.close()
        finally:
            for client in clients:
                await client.close()
            await registry.stop()

    _run(scenario())


def _fields(assignment: registry_pb2.Assignment) -> dict:
    return {f.name: v for f, v in assignment.ListFields()}


def test_a_stale_generation_status_is_refused_on_the_session():
    async def scenario():
        registry = await start_registry(FAST)
        clients = await _started(registry.address, range(4))
        try:
            assignments = await _assigned(clients)
            a = assignments[0]
            async with open_channel(registry.address) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                # on behalf of node-0's own session (another session may not speak for node-0)
                call = stub.Session(timeout=5)
                opening = registry_pb2.SessionOpen(node_id="node-0", instance_id=clients[0].instance_id)
                await call.write(registry_pb2.SessionRequest(open=opening))
                stale = registry_pb2.RankStatus(set_id=a.set_id, generation=a.generation - 1, ready=True)
                await call.write(registry_pb2.SessionRequest(status=stale))
                reply = await call.read()
                assert reply.WhichOneof("body") == "refusal"
                assert reply.refusal.current_generation == a.generation and "stale" in reply.refusal.reason
                call.cancel()
        finally:
            for client in clients:
                await client.close()
            await registry.stop()

    _run(scenario())


def test_decode_and_kvstore_appear_in_resolve_and_an_incomplete_assembly_is_reported():
    async def scenario():
        registry = await start_registry(FAST)
        decode = NodeSession(
            registry.address, "dec-0", "decode", "127.0.0.1:9500", EngineConfig(role="decode")
        )
        # --host-id: the machine routers compare, whatever the address says
        store = NodeSession(registry.address, "kv-0", "kvstore", "127.0.0.1:9600", host_id="machine-a")
        resolver = Resolver(registry.address)
        (lonely,) = await _started(registry.address, [0])
        try:
            for client in (decode, store):
                await client.start()
                await client.wait_registered(timeout=5)
            found = await resolver.resolve()
            assert [e.node_id for e in found.decode] == ["dec-0"] and [e.address for e in found.kvstore] == [
                "127.0.0.1:9600"
            ]
            assert [e.host for e in (*found.decode, *found.kvstore)] == ["127.0.0.1", "machine-a"]
            notice = await lonely.next_command(timeout=5)
            assert isinstance(notice, registry_pb2.AssemblyTimeout)
            assert (notice.registered, notice.required) == (1, 4)
        finally:
            for client in (decode, store, lonely):
                await client.close(deregister=True)
            await resolver.close()
            await registry.stop()

    _run(scenario())


@pytest.mark.slow
def test_a_killed_and_restarted_registry_gets_the_same_sets_back_without_relaunching(child_env):
    config = EngineConfig(data_parallel_size=1, nnodes=2, prefill_context_parallel_size=2)

    async def scenario(registry: RegistryProcess):
        address = registry.address
        clients = [_client(address, i, config=config) for i in range(2)]
        resolver = Resolver(address, ttl_s=0.0)
        for client in clients:
            await client.start()
        try:
            for client in clients:
                await client.wait_registered(timeout=15)
            assignments = await _assigned(clients)
            await _ready(clients)
            await until(lambda: _resolved_sets(address), timeout=10)
            assert [e.set_id for e in (await resolver.resolve()).prefill_sets] == [assignments[0].set_id]
            registry.kill()
            # routing continues from the cache while the registry is down
            cached = await resolver.resolve()
            assert [e.set_id for e in cached.prefill_sets] == [assignments[0].set_id]
            registry.start()
            found = await until(lambda: _resolved_sets(address), timeout=15)
            assert [(e.set_id, e.generation) for e in found] == [
                (assignments[0].set_id, assignments[0].generation)
            ]
            for client, assignment in zip(clients, assignments, strict=True):
                assert client.assignment == assignment
                with pytest.raises(TimeoutError):
                    await client.next_command(timeout=0.2)  # nothing to re-launch
        finally:
            for client in clients:
                await client.close()
            await resolver.close()

    with RegistryProcess(child_env) as registry:
        _run(scenario(registry))


def test_a_frozen_registry_holds_a_resolve_only_briefly_and_the_cached_endpoints_serve(child_env):
    """A registry that is stopped (SIGSTOP), not gone: its connection stays up and every Resolve would wait
    out its whole 5 s deadline. With an answer cached, a caller waits at most CACHED_WAIT_S while one ask
    runs in the background; then the cache serves at once until the registry answers again."""

    async def scenario(registry: RegistryProcess):
        resolver = Resolver(registry.address, ttl_s=0.0)
        try:
            known = await until(lambda: _resolved(resolver), timeout=15)
            registry.signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                waits = []
                for _ in range(6):
                    started = time.monotonic()
                    assert await resolver.resolve() == known
                    waits.append(time.monotonic() - started)
                # the first caller waits CACHED_WAIT_S, later ones not at all (each waited 5 s before)
                assert waits[0] < 2 * CACHED_WAIT_S + 1.0 and max(waits[1:]) < 0.5, waits
            finally:
                registry.signal(signal.SIGCONT)
            # answered again: the same resolver's cache is refreshed from the registry
            await until(lambda: _refreshed_after(resolver, frozen_at), timeout=15)
        finally:
            await resolver.close()

    with RegistryProcess(child_env) as registry:
        _run(scenario(registry))


async def _resolved(resolver: Resolver) -> object:
    """The resolver's answer, None while the registry does not listen yet."""
    try:
        return await resolver.resolve()
    except Unavailable:
        return None


async def _refreshed_after(resolver: Resolver, moment: float) -> bool:
    """Whether the resolver's cached answer came from the registry after moment (monotonic)."""
    await resolver.resolve()
    return resolver._cache[""].fetched_at > moment


def test_a_clock_tick_that_comes_late_extends_the_leases_instead_of_declaring_nodes_dead():
    """The servicer's clock, driven by a clock that jumps 10 s during one sleep (the event loop held up):
    the node, silent only while the registry could not listen, stays alive."""
    membership = Membership(FAST, 0.0)
    membership.register(
        Registration(node_id="kv-0", role="kvstore", address="127.0.0.1:9600", session="s"), 0.0
    )
    readings = iter([0.0, 10.0])

    def clock() -> float:
        return next(readings, 10.0)

    async def scenario():
        ticking = asyncio.create_task(RegistryServicer(membership, clock).run_clock(0.01))
        await asyncio.sleep(0.1)
        ticking.cancel()

    _run(scenario())
    assert [v.state for v in membership.nodes(10.0)] == [NodeState.READY]
    # silence after the stall counts as before
    membership.tick(10.0 + FAST.lease_s + 0.1)
    assert [v.state for v in membership.nodes(11.0)] == [NodeState.DEAD]


def test_a_register_carrying_an_absurd_assignment_is_answered_at_once_and_the_registry_keeps_serving():
    """A carried assignment is untrusted: tp_size 2**32 - 1 over 200,000 PCP ranks once had the registry
    listing 10**15 global ranks (a fuzzed Register hung it and grew it past 20 GB)."""

    async def scenario():
        registry = await start_registry(FAST)
        try:
            async with open_channel(registry.address, default_deadline=10) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                request = registry_pb2.RegisterRequest(
                    node_id="node-0",
                    role=common_pb2.NODE_ROLE_PREFILL,
                    address="127.0.0.1:9000",
                    engine_config=CONFIG.to_proto(),
                    kv_fingerprint="fp",
                    device_count=1,
                    current_assignment=registry_pb2.Assignment(
                        set_id="x-dp0", generation=1, tp_size=2**32 - 1, pcp_ranks=[7] * 200_000
                    ),
                )
                started = asyncio.get_running_loop().time()
                try:
                    await stub.Register(request)
                except grpc.aio.AioRpcError as exc:  # a refusal is fine, a crash or a hang is not
                    assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), exc
                    assert len(exc.details()) < 2000  # the 200,000 ranks are not spelled out
                assert asyncio.get_running_loop().time() - started < 10
                # still serving: another node registers
                request = registry_pb2.RegisterRequest(
                    node_id="kv-0", role=common_pb2.NODE_ROLE_KVSTORE, address="127.0.0.1:9600"
                )
                await stub.Register(request)
        finally:
            await registry.stop(grace=0)

    _run(scenario())
