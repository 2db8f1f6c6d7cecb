"""The registry's typed values and their protobuf forms, both ways: assignments, registrations, commands,
Resolve answers and the ListNodes/ListSets views. The servicer and the clients both convert here."""

from __future__ import annotations

from pcpstack.common.config import EngineConfig
from pcpstack.registry.assembly import Assignment
from pcpstack.registry.endpoints import PrefillEndpoint, Resolution, ServiceEndpoint
from pcpstack.registry.membership import (
    AssemblyTimedOut,
    Assign,
    Command,
    NodeState,
    NodeView,
    Registration,
    SetState,
    SetView,
    Stop,
)
from pcpstack.v1 import common_pb2, registry_pb2

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
# Trailer of a refusal that may clear by itself: the node id is bound to a session that has not ended yet.
REFUSAL_METADATA = "pcpstack-refusal"
REFUSAL_NODE_ID_IN_USE = "node-id-in-use"


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
        tp_size=assignment.tp_size,
        global_ranks=assignment.global_ranks,
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
        # A node from before TP wiring sends neither: tp 1, its global ranks are its PCP ranks. Nothing
        # is derived from a larger tp_size: a carried assignment is untrusted until assignment_problems
        # has checked it (tp_size 2**32 - 1 with 200,000 PCP ranks would be 10**15 ranks to list).
        tp_size=msg.tp_size or 1,
        global_ranks=tuple(msg.global_ranks) or (tuple(msg.pcp_ranks) if msg.tp_size <= 1 else ()),
    )


def registration_from_proto(request: registry_pb2.RegisterRequest, peer: str = "") -> Registration:
    """Reads a RegisterRequest from `peer` (its certificate identity, see server.peer_identity); raises
    ConfigError when the engine config breaks a rule."""
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
        session=session_identity(request.instance_id, peer),
        host_id=request.host_id,
    )


def session_identity(instance_id: str, peer: str) -> str:
    """What a live node id is bound to: the node process's instance token and, with mTLS, its verified
    certificate identity (so a copied token alone is not enough)."""
    return f"{instance_id}|{peer}" if peer else instance_id


def command_to_proto(command: Command) -> registry_pb2.SessionResponse:
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
    assert isinstance(command, AssemblyTimedOut)
    return registry_pb2.SessionResponse(
        assembly_timeout=registry_pb2.AssemblyTimeout(
            registered=command.registered, required=command.required, reason=command.reason
        )
    )


def _service_to_proto(e: ServiceEndpoint) -> registry_pb2.ServiceEndpoint:
    return registry_pb2.ServiceEndpoint(
        node_id=e.node_id, address=e.address, load=e.load, kv_fingerprint=e.kv_fingerprint, host=e.host
    )


def _service_from_proto(e: registry_pb2.ServiceEndpoint) -> ServiceEndpoint:
    return ServiceEndpoint(e.node_id, e.address, e.load, e.kv_fingerprint, e.host)


def resolution_to_proto(found: Resolution, warming: bool) -> registry_pb2.ResolveResponse:
    """A Resolve answer on the wire; `warming` while the registry may not have heard from every node."""
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
        decode=[_service_to_proto(e) for e in found.decode],
        kvstore=[_service_to_proto(e) for e in found.kvstore],
        warming=warming,
    )


def resolution_from_proto(msg: registry_pb2.ResolveResponse) -> Resolution:
    """The typed form of a Resolve answer."""
    return Resolution(
        prefill_sets=tuple(
            PrefillEndpoint(e.set_id, e.generation, e.address, e.pcp_size, e.load, e.kv_fingerprint, e.model)
            for e in msg.prefill_sets
        ),
        decode=tuple(_service_from_proto(e) for e in msg.decode),
        kvstore=tuple(_service_from_proto(e) for e in msg.kvstore),
        warming=msg.warming,
    )


def node_to_proto(v: NodeView) -> registry_pb2.NodeStatus:
    """One ListNodes entry."""
    return registry_pb2.NodeStatus(
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


def set_to_proto(v: SetView) -> registry_pb2.PcpSet:
    """One ListSets entry."""
    return registry_pb2.PcpSet(
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
