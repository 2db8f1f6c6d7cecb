"""The registry's gRPC servicer: turns protobuf into Membership calls and results into protobuf.

Besides translation it owns what the pure core cannot: the clock (a periodic tick that expires leases and
times out assemblies), one mailbox per node whose commands a Session stream drains, and the optional
snapshot file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from pcpstack.common import security
from pcpstack.common.config import ConfigError, EngineConfig
from pcpstack.common.server import RunningServer, ServerOptions, start_server
from pcpstack.registry.assembly import Assignment
from pcpstack.registry.membership import (
    Ack,
    AssemblyTimedOut,
    Assign,
    Membership,
    NodeState,
    Outgoing,
    Refused,
    Registration,
    SetState,
    Settings,
    Stop,
    split_host_port,
)
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name
ROLE_NAMES = {
    common_pb2.NODE_ROLE_PREFILL: "prefill",
    common_pb2.NODE_ROLE_DECODE: "decode",
    common_pb2.NODE_ROLE_KVSTORE: "kvstore",
}
ROLE_VALUES = {name: value for value, name in ROLE_NAMES.items()}
NODE_STATES = {
    NodeState.POOLED: registry_pb2.NODE_STATE_POOLED,
    NodeState.ASSIGNED: registry_pb2.NODE_STATE_ASSIGNED,
    NodeState.READY: registry_pb2.NODE_STATE_READY,
    NodeState.DEAD: registry_pb2.NODE_STATE_DEAD,
}
SET_STATES = {
    SetState.STARTING: registry_pb2.SET_STATE_STARTING,
    SetState.READY: registry_pb2.SET_STATE_READY,
    SetState.BROKEN: registry_pb2.SET_STATE_BROKEN,
}
_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "not_found": grpc.StatusCode.NOT_FOUND,
}


def assignment_to_proto(assignment: Assignment | None) -> registry_pb2.Assignment | None:
    """The wire form of an assignment (None stays None)."""
    if assignment is None:
        return None
    return registry_pb2.Assignment(
        set_id=assignment.set_id,
        generation=assignment.generation,
        node_rank=assignment.node_rank,
        nnodes=assignment.nnodes,
        master_addr=assignment.master_addr,
        master_port=assignment.master_port,
        headless=assignment.headless,
        dp_rank=assignment.dp_rank,
        pcp_size=assignment.pcp_size,
        pcp_ranks=assignment.pcp_ranks,
        member_node_ids=assignment.member_node_ids,
    )


def assignment_from_proto(msg: registry_pb2.Assignment) -> Assignment:
    """The core's form of a wire assignment."""
    return Assignment(
        set_id=msg.set_id,
        generation=msg.generation,
        node_rank=msg.node_rank,
        nnodes=msg.nnodes,
        master_addr=msg.master_addr,
        master_port=msg.master_port,
        headless=msg.headless,
        dp_rank=msg.dp_rank,
        pcp_size=msg.pcp_size,
        pcp_ranks=tuple(msg.pcp_ranks),
        member_node_ids=tuple(msg.member_node_ids),
    )


def registration_from_proto(request: registry_pb2.RegisterRequest) -> Registration:
    """Reads a RegisterRequest; raises ConfigError when the engine config breaks a rule."""
    role = ROLE_NAMES.get(request.role, "")
    config = EngineConfig.from_proto(request.engine_config, role) if role in ("prefill", "decode") else None
    carried = request.current_assignment if request.HasField("current_assignment") else None
    return Registration(
        node_id=request.node_id,
        role=role,
        address=request.address,
        device_count=request.device_count,
        engine_config=config,
        kv_fingerprint=request.kv_fingerprint,
        current_assignment=assignment_from_proto(carried) if carried and carried.set_id else None,
        dist_host=request.dist_host,
    )


def command_to_proto(command: Assign | Stop | AssemblyTimedOut) -> registry_pb2.SessionResponse:
    """A core command as the Session message that carries it."""
    if isinstance(command, Assign):
        return registry_pb2.SessionResponse(
            assign=registry_pb2.AssignCommand(assignment=assignment_to_proto(command.assignment))
        )
    if isinstance(command, Stop):
        return registry_pb2.SessionResponse(
            stop=registry_pb2.StopCommand(
                set_id=command.set_id, generation=command.generation, reason=command.reason
            )
        )
    return registry_pb2.SessionResponse(
        assembly_timeout=registry_pb2.AssemblyTimeout(
            registered=command.registered, required=command.required, reason=command.reason
        )
    )


class Mailboxes:
    """One queue of outgoing Session messages per node; at most one Session drains it at a time.

    A node's queue outlives its streams, so commands issued while it reconnects are not lost. A newer
    Session (or a re-registration) takes the queue over; the older stream gets None and ends.
    """

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[registry_pb2.SessionResponse | None]] = {}

    def post(self, node_id: str, message: registry_pb2.SessionResponse) -> None:
        """Queues a message for the node's current or next Session."""
        self._queues.setdefault(node_id, asyncio.Queue()).put_nowait(message)

    def attach(self, node_id: str) -> asyncio.Queue[registry_pb2.SessionResponse | None]:
        """A fresh queue for a new Session, holding what was pending; the previous Session ends."""
        fresh: asyncio.Queue[registry_pb2.SessionResponse | None] = asyncio.Queue()
        old = self._queues.get(node_id)
        if old is not None:
            while not old.empty():
                if (message := old.get_nowait()) is not None:
                    fresh.put_nowait(message)
            old.put_nowait(None)
        self._queues[node_id] = fresh
        return fresh

    def detach(self, node_id: str, queue: asyncio.Queue) -> None:
        """A Session ended: its pending messages stay for the next one."""
        if self._queues.get(node_id) is queue:
            self.attach(node_id)

    def reset(self, node_id: str) -> None:
        """Drops what is pending (a re-registration starts from the response's truth) and ends the
        node's current Session."""
        old = self._queues.pop(node_id, None)
        if old is not None:
            old.put_nowait(None)


@dataclass
class _Failure:
    refused: Refused | None = None


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """RegistryService over a Membership; every state change's commands go to the nodes' mailboxes."""

    def __init__(
        self,
        membership: Membership,
        clock: Callable[[], float] = time.monotonic,
        snapshot_path: Path | None = None,
        verify_peer_address: bool = True,
    ) -> None:
        self._membership = membership
        self._verify_peer_address = verify_peer_address
        self._clock = clock
        self._mailboxes = Mailboxes()
        self._snapshot_path = snapshot_path
        self._dirty = False

    def deliver(self, out: Outgoing) -> None:
        """Posts commands to mailboxes and logs what a reader of the logs wants to know."""
        for node_id, command in out:
            self._mailboxes.post(node_id, command_to_proto(command))
            if isinstance(command, Assign) and command.assignment.node_rank == 0:
                a = command.assignment
                log.info(
                    "set formed",
                    extra={
                        "set_id": a.set_id,
                        "generation": a.generation,
                        "members": list(a.member_node_ids),
                    },
                )
            elif isinstance(command, Stop):
                log.warning(
                    "node told to stop",
                    extra={"node_id": node_id, "set_id": command.set_id, "reason": command.reason},
                )
            elif isinstance(command, AssemblyTimedOut):
                log.warning("assembly timed out", extra={"node_id": node_id, "reason": command.reason})
        if out:
            self._dirty = True

    async def Register(self, request, context):
        """Validates and records the node; the response carries its assignment when it has one."""
        try:
            registration = registration_from_proto(request)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"engine_config: {exc}")
        # The core names a missing identity first; a node that has one must advertise its own host.
        if self._verify_peer_address and registration.node_id and registration.role:
            await self._check_advertised(registration, context)
        try:
            assignment, out = self._membership.register(registration, self._clock())
        except Refused as exc:
            await context.abort(_CODES[exc.kind], str(exc))
        self._mailboxes.reset(request.node_id)
        self.deliver(out)
        self._dirty = True
        log.info("registered", extra={"node_id": request.node_id, "role": registration.role})
        return registry_pb2.RegisterResponse(
            node_id=request.node_id,
            lease_ms=int(self._membership.settings.lease_s * 1000),
            assignment=assignment_to_proto(assignment),
        )

    async def _check_advertised(self, registration: Registration, context) -> None:
        """Refuses a node that advertises (address, dist_host) a host other than its own, so it cannot
        point routers or its set's ranks elsewhere (--verify-peer-address)."""
        peer = security.peer_ip(context.peer())
        if peer is None:
            return  # not an IP transport (a unix socket): the peer is local
        try:
            address_host = split_host_port(registration.address)[0]
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        names = security.certificate_names(context.auth_context())
        for name, host in (("address", address_host), ("dist_host", registration.dist_host)):
            if not host:
                continue
            broken = await security.advertised_host_allowed(host, peer, names)
            if broken is not None:
                value = registration.address if name == "address" else host
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{name}={value!r} refused: {broken}; rule: a node advertises its own address "
                    "(registry --verify-peer-address)",
                )

    async def Session(self, request_iterator, context):
        """Reads heartbeats and status reports; yields commands, acks and refusals. (A generator, not
        context.write: the OpenTelemetry server interceptor wraps streaming handlers as generators.)"""
        requests = aiter(request_iterator)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        if first.WhichOneof("body") != "open" or not first.open.node_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first Session message must be `open` with a node_id"
            )
        node_id = first.open.node_id
        try:
            self._membership.open_session(node_id, self._clock())
        except Refused as exc:
            await context.abort(_CODES[exc.kind], str(exc))
        queue = self._mailboxes.attach(node_id)
        failure = _Failure()
        reader = asyncio.create_task(self._read(requests, node_id, queue, failure))
        try:
            while (message := await queue.get()) is not None:
                yield message
        finally:
            reader.cancel()
            self._mailboxes.detach(node_id, queue)
        if failure.refused is not None:
            await context.abort(_CODES[failure.refused.kind], str(failure.refused))

    async def _read(self, requests, node_id: str, queue: asyncio.Queue, failure: _Failure) -> None:
        try:
            async for request in requests:
                queue.put_nowait(self._on_session_message(node_id, request))
        except Refused as exc:
            failure.refused = exc
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        queue.put_nowait(None)

    def _on_session_message(self, node_id: str, request) -> registry_pb2.SessionResponse:
        now = self._clock()
        kind = request.WhichOneof("body")
        if kind == "heartbeat":
            reply = self._membership.heartbeat(
                node_id, request.heartbeat.generation, request.heartbeat.load, now
            )
        elif kind == "status":
            status = request.status
            reply, out = self._membership.report_status(
                node_id, status.set_id, status.generation, status.ready, status.error, now
            )
            self.deliver(out)
            self._dirty = True
        else:
            self._membership.open_session(node_id, now)
            reply = Ack(0)
        if isinstance(reply, Ack):
            return registry_pb2.SessionResponse(ack=registry_pb2.HeartbeatAck(generation=reply.generation))
        return registry_pb2.SessionResponse(
            refusal=registry_pb2.Refusal(reason=reply.reason, current_generation=reply.current_generation)
        )

    async def Resolve(self, request, context):
        """Ready prefill sets, decode and KV store endpoints."""
        found = self._membership.resolve(request.model)
        return registry_pb2.ResolveResponse(
            prefill_sets=[
                registry_pb2.PrefillSetEndpoint(
                    set_id=e.set_id,
                    generation=e.generation,
                    address=e.address,
                    pcp_size=e.pcp_size,
                    load=e.load,
                    kv_fingerprint=e.kv_fingerprint,
                    model=e.model,
                )
                for e in found.prefill_sets
            ],
            decode=[_endpoint(e) for e in found.decode],
            kvstore=[_endpoint(e) for e in found.kvstore],
        )

    async def ListNodes(self, request, context):
        """Every node with its state."""
        return registry_pb2.ListNodesResponse(
            nodes=[
                registry_pb2.NodeStatus(
                    node_id=v.node_id,
                    role=ROLE_VALUES[v.role],
                    address=v.address,
                    state=NODE_STATES[v.state],
                    assignment=assignment_to_proto(v.assignment),
                    last_seen_ms_ago=int(v.last_seen_s_ago * 1000),
                    load=v.load,
                    last_error=v.last_error,
                    device_count=v.device_count,
                    model=v.model,
                )
                for v in self._membership.nodes(self._clock())
            ]
        )

    async def ListSets(self, request, context):
        """Every set, formed or forming (and broken ones until re-formed)."""
        return registry_pb2.ListSetsResponse(
            sets=[
                registry_pb2.PcpSet(
                    set_id=v.set_id,
                    generation=v.generation,
                    dp_rank=v.dp_rank,
                    state=SET_STATES[v.state],
                    member_node_ids=v.member_node_ids,
                    master_address=v.master_address,
                    pcp_size=v.pcp_size,
                    reason=v.reason,
                    model=v.model,
                )
                for v in self._membership.sets()
            ]
        )

    async def Deregister(self, request, context):
        """Removes a node; its set breaks and its Session ends."""
        if not request.node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id is required")
        removed, out = self._membership.deregister(request.node_id, self._clock())
        self._mailboxes.reset(request.node_id)
        self.deliver(out)
        self._dirty = self._dirty or removed
        log.info("deregistered", extra={"node_id": request.node_id, "known": removed})
        return registry_pb2.DeregisterResponse(removed=removed)

    async def run_clock(self, interval: float) -> None:
        """Ticks the core every interval seconds and keeps the snapshot file fresh; runs until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.deliver(self._membership.tick(self._clock()))
            if self._dirty and self._snapshot_path is not None:
                self._dirty = False
                write_snapshot(self._snapshot_path, self._membership.snapshot())


def _endpoint(e) -> registry_pb2.ServiceEndpoint:
    return registry_pb2.ServiceEndpoint(
        node_id=e.node_id, address=e.address, load=e.load, kv_fingerprint=e.kv_fingerprint
    )


def read_snapshot(path: Path) -> dict | None:
    """The snapshot at path, or None when there is none or it cannot be read (a restart never depends on
    it)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("snapshot unreadable; starting without it", extra={"path": str(path), "error": str(exc)})
        return None


def write_snapshot(path: Path, snapshot: dict) -> None:
    """Writes atomically (temp file + rename), so a crash never leaves half a snapshot."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(snapshot))
    os.replace(tmp, path)


class RegistryServer:
    """A running registry: the gRPC server plus its clock."""

    def __init__(self, running: RunningServer, servicer: RegistryServicer, clock_task: asyncio.Task) -> None:
        self.running = running
        self.servicer = servicer
        self._clock_task = clock_task

    @property
    def address(self) -> str:
        """host:port clients dial."""
        return self.running.address

    async def stop(self, grace: float | None = None) -> None:
        """Stops the clock and the server."""
        self._clock_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._clock_task
        await self.running.stop(grace)


async def start_registry(
    settings: Settings | None = None,
    options: ServerOptions | None = None,
    snapshot_path: Path | None = None,
    verify_peer_address: bool = True,
) -> RegistryServer:
    """Starts a registry. With a snapshot_path, an existing snapshot is read (the restore grace then ends
    as soon as its sets' members are back) and a missing one means a cold start with no grace at all.
    verify_peer_address refuses registrations whose advertised host is not the caller's own."""
    settings = settings or Settings()
    options = options or ServerOptions()
    now = time.monotonic()
    snapshot = read_snapshot(snapshot_path) if snapshot_path is not None else None
    if snapshot_path is not None and snapshot is None:
        settings = replace(settings, restore_grace_s=0.0)
    membership = Membership(settings, now, snapshot)
    servicer = RegistryServicer(membership, time.monotonic, snapshot_path, verify_peer_address)
    running = await start_server(
        lambda server: registry_pb2_grpc.add_RegistryServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        options,
    )
    clock = asyncio.create_task(servicer.run_clock(min(0.25, settings.lease_s / 4)))
    return RegistryServer(running, servicer, clock)
