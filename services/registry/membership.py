"""The registry's books: nodes, their leases, groups of peers, PCP sets and their generations.

Plain Python with no gRPC and no clock of its own: every method takes `now`, so tests drive time. Each
change returns the commands the servicer must deliver on the nodes' Session streams, as (node_id, command)
pairs. Rules kept here:
- peers of one role and model agree on their engine config and KV fingerprint;
- a set is formed by `assembly.plan_sets`, only after the restore grace that follows a (re)start, so that
  nodes re-registering with their current assignment get their slots back before new sets are formed;
- one dead, departed or failing member breaks its whole set at once: survivors are stopped and pooled, and
  the slot is re-formed with a new generation from the pool;
- generations are globally monotonic: every new set gets max(seen) + 1, including generations carried by
  nodes after a restart;
- a set is routable only once every member reported ready for its generation;
- a live node id is bound to the session that registered it (the node process's instance token and, with
  mTLS, its certificate): another session may take the id over only once the first one has ended.
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import asdict, dataclass, field

from pcpstack.common.config import ConfigError, EngineConfig, check_node_id
from pcpstack.common.errors import FailedPrecondition, InvalidArgument, NotFound
from pcpstack.registry.assembly import (
    Assignment,
    Candidate,
    SetShape,
    assignment_problems,
    config_differences,
    global_ranks_of,
    group_label,
    pcp_ranks_of,
    plan_sets,
)
from pcpstack.registry.endpoints import PrefillEndpoint, Resolution, ServiceEndpoint

ROLES = ("prefill", "decode", "kvstore")
SNAPSHOT_VERSION = 1
# Generations stay at most this: a node may carry one below it (sets formed later count on from it), a
# snapshot may hold up to it. A registry issues one per set it forms, so a real one stays far below; 2**53
# is the largest integer a JSON reader that uses doubles reads exactly, and far inside the proto's uint64.
MAX_GENERATION = 2**53

log = logging.getLogger(__name__)


class NodeState(enum.Enum):
    """A node as the registry sees it (mirrors the proto NodeState)."""

    POOLED = "pooled"
    ASSIGNED = "assigned"
    READY = "ready"
    DEAD = "dead"


class SetState(enum.Enum):
    """A PCP set's state (mirrors the proto SetState)."""

    STARTING = "starting"
    READY = "ready"
    BROKEN = "broken"


class NodeIdInUse(FailedPrecondition):
    """The node id is bound to another live session; it frees up once that session ends (its lease expires
    or it deregisters), so a restarted node may retry."""


@dataclass(frozen=True)
class Settings:
    """Timing of the registry, in seconds."""

    lease_s: float = 3.0
    assembly_timeout_s: float = 60.0
    restore_grace_s: float = 6.0
    # whether restore_grace_s was asked for (--restore-grace): then it holds even on a cold start, which
    # otherwise has none (no stored sets to wait for)
    restore_grace_given: bool = False
    dead_retention_s: float = 600.0
    # after a (re)start, how long live nodes may take to come back (their sessions retry every 2 s at most)
    warmup_s: float = 5.0


# The longest each string of a registration may be: every one is kept, written to etcd and sent in each
# Resolve answer, whose size gRPC limits for all nodes together.
MAX_FIELD_CHARS = {
    "node_id": 256,
    "address": 512,
    "dist_host": 512,
    "host_id": 256,
    "kv_fingerprint": 256,
    "engine_config.model": 4096,
}
# The most of a rank's failure report a registry keeps (it is logged and named in the set's break reason).
MAX_STATUS_ERROR_CHARS = 2048


@dataclass(frozen=True)
class Registration:
    """What a node announces. engine_config is None for a KV store."""

    node_id: str
    role: str
    address: str
    device_count: int = 0
    engine_config: EngineConfig | None = None
    kv_fingerprint: str = ""
    current_assignment: Assignment | None = None
    dist_host: str = ""
    # who registered: the node process's instance token and, with mTLS, its certificate's names
    session: str = ""
    # the machine it runs on when the host of `address` does not say it (--host-id)
    host_id: str = ""

    @property
    def model(self) -> str:
        """Model the node serves ("" for a KV store)."""
        return self.engine_config.model if self.engine_config else ""

    @property
    def host(self) -> str:
        """The host the node runs on, as routers compare it: its host_id, else the host of `address` (""
        when address is not host:port). A decode worker and a KV store on one host share memory."""
        if self.host_id:
            return self.host_id
        try:
            return split_host_port(self.address)[0]
        except ValueError:
            return ""

    @property
    def master_host(self) -> str:
        """Host other members dial for torch.distributed when this node is a set's master."""
        return self.dist_host or split_host_port(self.address)[0]

    def same_node_as(self, other: Registration) -> bool:
        """True when other describes the same running node (everything but the carried assignment)."""
        return (
            self.role,
            self.address,
            self.device_count,
            self.engine_config,
            self.kv_fingerprint,
            self.dist_host,
            self.host_id,
        ) == (
            other.role,
            other.address,
            other.device_count,
            other.engine_config,
            other.kv_fingerprint,
            other.dist_host,
            other.host_id,
        )


@dataclass(frozen=True)
class Assign:
    """Command: run this assignment."""

    assignment: Assignment


@dataclass(frozen=True)
class Stop:
    """Command: leave this set and go back to the pool."""

    set_id: str
    generation: int
    reason: str


@dataclass(frozen=True)
class AssemblyTimedOut:
    """Command (a notice): not enough nodes came in time; the node stays pooled."""

    registered: int
    required: int
    reason: str


Command = Assign | Stop | AssemblyTimedOut
Outgoing = list[tuple[str, Command]]


@dataclass(frozen=True)
class Ack:
    """Reply to a Session message that was accepted."""

    generation: int


@dataclass(frozen=True)
class Refusal:
    """Reply to a Session message that was refused (stale generation, unknown set)."""

    reason: str
    current_generation: int


@dataclass(frozen=True)
class NodeView:
    """One node for ListNodes."""

    node_id: str
    role: str
    address: str
    state: NodeState
    assignment: Assignment | None
    last_seen_s_ago: float
    load: int
    last_error: str
    device_count: int
    model: str


@dataclass(frozen=True)
class SetView:
    """One set for ListSets."""

    set_id: str
    generation: int
    dp_rank: int
    state: SetState
    member_node_ids: tuple[str, ...]
    master_address: str
    pcp_size: int
    reason: str
    model: str


def split_host_port(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; raises ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address={address!r} must be host:port with a port in 1..65535")
    return host, int(port)


GroupKey = tuple[str, str]  # (role, model)


@dataclass
class _Node:
    registration: Registration
    seq: int
    last_seen: float
    alive: bool = True
    load: int = 0
    assignment: Assignment | None = None
    # decode/kvstore readiness; prefill readiness is per set
    ready: bool = True
    last_error: str = ""

    @property
    def group(self) -> GroupKey:
        return (self.registration.role, self.registration.model)


@dataclass
class _Group:
    role: str
    model: str
    config: EngineConfig | None = None
    kv_fingerprint: str = ""
    label: str = ""
    live: dict[str, None] = field(default_factory=dict)
    pooled: dict[str, int] = field(default_factory=dict)
    slots: dict[int, str] = field(default_factory=dict)
    # dp ranks of slots whose set is broken (kept so that finding free slots never walks every slot)
    broken: set[int] = field(default_factory=set)
    assembled: bool = False
    waiting_since: float | None = None


@dataclass
class _Set:
    group: GroupKey
    assignments: tuple[Assignment, ...]
    state: SetState = SetState.STARTING
    present: set[str] = field(default_factory=set)
    ready: set[str] = field(default_factory=set)
    # set only while the set is being restored after a restart: members must be back by then
    restore_deadline: float | None = None
    reason: str = ""

    @property
    def head(self) -> Assignment:
        return self.assignments[0]

    @functools.cached_property
    def head_record(self) -> dict:
        """The head assignment as a dict, for snapshots (asdict is slow, and the assignment never changes)."""
        return asdict(self.head)

    @property
    def members(self) -> tuple[str, ...]:
        return self.head.member_node_ids


def _all_ranks(carried: Assignment) -> tuple[Assignment, ...]:
    """Every member's assignment of the set a node's carried assignment belongs to."""
    return tuple(
        Assignment(
            **{
                **asdict(carried),
                "node_rank": rank,
                "headless": rank != 0,
                "pcp_ranks": pcp_ranks_of(rank, carried.pcp_size, len(carried.member_node_ids)),
                "global_ranks": global_ranks_of(
                    pcp_ranks_of(rank, carried.pcp_size, len(carried.member_node_ids)), carried.tp_size
                ),
                "member_node_ids": tuple(carried.member_node_ids),
            }
        )
        for rank in range(len(carried.member_node_ids))
    )


def validate(reg: Registration) -> None:
    """Refuses a registration that is wrong on its own, whatever the registry holds: InvalidArgument for
    a missing, malformed or overlong identity (common.config.NODE_ID_CHARS), role, address or engine
    config, or a carried generation above MAX_GENERATION; FailedPrecondition for too few devices."""
    if not reg.node_id:
        raise InvalidArgument("node_id is required (a stable identity of the node)")
    for name, limit in MAX_FIELD_CHARS.items():
        value = reg.model if name == "engine_config.model" else getattr(reg, name)
        if len(value) > limit:
            raise InvalidArgument(f"{name} is {len(value)} characters; at most {limit}")
    try:
        check_node_id("node_id", reg.node_id)
    except ConfigError as exc:
        raise InvalidArgument(str(exc)) from None
    if reg.role not in ROLES:
        raise InvalidArgument(f"role is required: one of {', '.join(ROLES)}")
    try:
        split_host_port(reg.address)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    carried = reg.current_assignment
    if carried is not None and carried.generation >= MAX_GENERATION:
        raise InvalidArgument(
            f"current_assignment.generation={carried.generation} must be below {MAX_GENERATION} "
            "(2**53): a registry issues one generation per set it forms, so a real one is far smaller, "
            "and the sets formed after it count on from it"
        )
    config = reg.engine_config
    if reg.role != "kvstore" and config is None:
        raise InvalidArgument(f"engine_config is required for a {reg.role} node")
    if reg.role == "prefill" and config is not None and reg.device_count:
        needed = config.tensor_parallel_size * config.pcp_ranks_per_node
        if reg.device_count < needed:
            raise FailedPrecondition(
                f"device_count={reg.device_count} but tensor_parallel_size="
                f"{config.tensor_parallel_size} x (prefill_context_parallel_size / nnodes)="
                f"{config.pcp_ranks_per_node} needs {needed} devices per node",
            )


class Membership:
    """The registry's state machine. Not thread-safe: one event loop owns it."""

    def __init__(self, settings: Settings, now: float, snapshot: dict | None = None) -> None:
        """A registry that started at `now`. With a snapshot (from `snapshot()`), its sets are awaited
        from their members and the restore grace ends as soon as they are all back."""
        self.settings = settings
        self._nodes: dict[str, _Node] = {}
        self._groups: dict[GroupKey, _Group] = {}
        self._sets: dict[str, _Set] = {}
        # sets being restored after a (re)start, by set id: a registering node looks only among these
        self._restoring: dict[str, _Set] = {}
        self._seq = 0
        self._max_generation = 0
        # counts changes of what `snapshot()` holds (sets, their breaking, the generation counter)
        self._revision = 0
        self._started = now
        self._grace_until = now + settings.restore_grace_s
        self._grace_over = settings.restore_grace_s <= 0
        self._snapshot_restored = snapshot is not None
        if snapshot is not None:
            self._restore(snapshot, now)

    # --- node requests ---------------------------------------------------------------------------

    def register(self, reg: Registration, now: float) -> tuple[Assignment | None, Outgoing]:
        """Adds or refreshes a node; returns its assignment (if it has one now) and the commands for
        other nodes. Raises InvalidArgument for bad input, FailedPrecondition for a config that disagrees
        with its peers, and NodeIdInUse when the id is bound to another live session."""
        validate(reg)
        existing = self._nodes.get(reg.node_id)
        if existing is not None and existing.alive:
            self._check_session(existing, reg.session, "register")
        group = self._group(reg.role, reg.model)
        self._check_peers(group, reg)
        out: Outgoing = []
        if existing is not None and existing.alive and existing.registration.same_node_as(reg):
            existing.last_seen = now
            if existing.assignment is not None:
                return existing.assignment, out
        elif existing is not None:
            out += self._remove(existing, f"member {reg.node_id} registered again", now)
        if not group.live:
            self._reset_group(group, reg)
        node = self._nodes.get(reg.node_id)
        if node is None or not node.alive:
            self._seq += 1
            node = _Node(reg, self._seq, now)
            self._nodes[reg.node_id] = node
            group.live[reg.node_id] = None
        if reg.role == "prefill":
            group.pooled[reg.node_id] = node.seq
            out += self._adopt(node, group, reg.current_assignment, now)
            out += self._end_grace_if_due(now)
            out += self._assemble(group, now)
        # the registrant learns its assignment from the response, not from a duplicate command
        return node.assignment, [
            (nid, c) for nid, c in out if not (nid == reg.node_id and isinstance(c, Assign))
        ]

    def open_session(self, node_id: str, now: float, session: str = "") -> None:
        """A node opened its Session stream. Raises NotFound for an unknown or dead node and NodeIdInUse
        when `session` is not the one that registered it."""
        node = self._live_node(node_id)
        self._check_session(node, session, "open a session for")
        node.last_seen = now

    def heartbeat(self, node_id: str, generation: int, load: int, now: float) -> Ack | Refusal:
        """Renews a node's lease and records its load; a non-zero stale generation is refused (the lease
        is renewed anyway: the node is alive, it just has not caught up)."""
        node = self._live_node(node_id)
        node.last_seen = now
        node.load = load
        current = node.assignment.generation if node.assignment else 0
        if generation and generation != current:
            return Refusal(f"heartbeat carries generation {generation}; the node's is {current}", current)
        return Ack(current)

    def report_status(
        self, node_id: str, set_id: str, generation: int, ready: bool, error: str, now: float
    ) -> tuple[Ack | Refusal, Outgoing]:
        """A node reports readiness (or a failure) of its ranks for one set generation. Decode and KV store
        nodes report with an empty set_id and generation 0."""
        node = self._live_node(node_id)
        node.last_seen = now
        if len(error) > MAX_STATUS_ERROR_CHARS:
            left_out = len(error) - MAX_STATUS_ERROR_CHARS
            error = f"{error[:MAX_STATUS_ERROR_CHARS]}... ({left_out} characters left out)"
        node.last_error = error
        current = node.assignment.generation if node.assignment else 0
        if node.registration.role != "prefill":
            if set_id or generation:
                return Refusal(f"a {node.registration.role} node has no set; send an empty set_id", 0), []
            node.ready = ready and not error
            return Ack(0), []
        if node.assignment is None or (set_id, generation) != (node.assignment.set_id, current):
            held = f"{node.assignment.set_id} generation {current}" if node.assignment else "no assignment"
            return Refusal(
                f"status for {set_id or '(no set)'} generation {generation} is stale; the node holds {held}",
                current,
            ), []
        pcp_set = self._sets[set_id]
        if error:
            out = self._break(pcp_set, f"member {node_id} failed: {error}")
            return Ack(current), out + self._assemble(self._groups[pcp_set.group], now)
        if ready:
            pcp_set.ready.add(node_id)
        else:
            pcp_set.ready.discard(node_id)
        self._update_readiness(pcp_set)
        return Ack(current), []

    def deregister(self, node_id: str, now: float, session: str = "") -> tuple[bool, Outgoing]:
        """Removes a node for good; its set, if any, breaks. Returns whether the node was known. Only the
        session that registered a live node may remove it (NodeIdInUse otherwise)."""
        node = self._nodes.get(node_id)
        if node is None:
            return False, []
        if node.alive:
            self._check_session(node, session, "deregister")
        return True, self._remove(node, f"member {node_id} deregistered", now)

    def lapse(self, node_id: str, now: float) -> Outgoing:
        """The replica holding a node's session through etcd heard nothing from it for its lease: the node
        is dead now, as if it had missed its lease here (its set breaks at once, not a lease later)."""
        node = self._nodes.get(node_id)
        if node is None or not node.alive:
            return []
        return self._kill(node, f"member {node_id} missed its lease", now)

    # --- time --------------------------------------------------------------------------------------

    def excuse(self, stalled_s: float, now: float) -> None:
        """The registry could not read heartbeats for stalled_s seconds (its event loop was held up: CPU
        starvation, a long change): every live node's lease is extended by that much, so that no node is
        declared dead for a silence that was the registry's own."""
        for node in self._nodes.values():
            if node.alive:
                node.last_seen = min(now, node.last_seen + stalled_s)

    def tick(self, now: float) -> Outgoing:
        """Applies everything time does: expired leases, restores that did not complete, the end of the
        restore grace, assembly timeouts, and forgetting long-dead nodes."""
        out: Outgoing = []
        lease = self.settings.lease_s
        for node in [n for n in self._nodes.values() if n.alive and now - n.last_seen > lease]:
            out += self._kill(node, f"member {node.registration.node_id} missed its lease", now)
        for pcp_set in list(self._restoring.values()):
            if pcp_set.restore_deadline is not None and now >= pcp_set.restore_deadline:
                missing = sorted(set(pcp_set.members) - pcp_set.present)
                out += self._break(pcp_set, f"members {missing} did not come back after the restart")
                out += self._assemble(self._groups[pcp_set.group], now)
        out += self._end_grace_if_due(now)
        for group in self._groups.values():
            if (
                group.waiting_since is not None
                and now - group.waiting_since >= self.settings.assembly_timeout_s
            ):
                out += self._time_out_assembly(group, now)
        retention = self.settings.dead_retention_s
        for node in [n for n in self._nodes.values() if not n.alive and now - n.last_seen > retention]:
            del self._nodes[node.registration.node_id]
        return out

    # --- views -------------------------------------------------------------------------------------

    def resolve(self, model: str = "") -> Resolution:
        """Ready prefill sets (least loaded first) and live, ready decode and KV store endpoints."""
        prefill = []
        for pcp_set in self._sets.values():
            group = self._groups[pcp_set.group]
            if pcp_set.state is not SetState.READY or (model and group.model != model):
                continue
            master = self._nodes[pcp_set.members[0]]
            prefill.append(
                PrefillEndpoint(
                    pcp_set.head.set_id,
                    pcp_set.head.generation,
                    master.registration.address,
                    pcp_set.head.pcp_size,
                    master.load,
                    group.kv_fingerprint,
                    group.model,
                )
            )
        prefill.sort(key=lambda e: (e.load, e.set_id))
        endpoints: dict[str, list[ServiceEndpoint]] = {"decode": [], "kvstore": []}
        for node in self._nodes.values():
            reg = node.registration
            if reg.role == "prefill" or not (node.alive and node.ready):
                continue
            if reg.role == "decode" and model and reg.model != model:
                continue
            endpoints[reg.role].append(
                ServiceEndpoint(reg.node_id, reg.address, node.load, reg.kv_fingerprint, reg.host)
            )
        for found in endpoints.values():
            found.sort(key=lambda e: (e.load, e.node_id))
        return Resolution(tuple(prefill), tuple(endpoints["decode"]), tuple(endpoints["kvstore"]))

    def warming(self, now: float) -> bool:
        """True until every node that was alive before a (re)start has had time to come back: during the
        restore grace, and for warmup_s (at least two leases) after the start. Empty endpoint lists are
        then not yet the truth."""
        warmup = max(self.settings.warmup_s, 2 * self.settings.lease_s)
        return self.restoring or now < self._started + warmup

    def nodes(self, now: float) -> list[NodeView]:
        """Every known node, in registration order."""
        return [
            NodeView(
                node.registration.node_id,
                node.registration.role,
                node.registration.address,
                self._node_state(node),
                node.assignment,
                max(0.0, now - node.last_seen),
                node.load,
                node.last_error,
                node.registration.device_count,
                node.registration.model,
            )
            for node in sorted(self._nodes.values(), key=lambda n: n.seq)
        ]

    def sets(self) -> list[SetView]:
        """Every set (broken ones until their slot is re-formed), by model then dp_rank."""
        views = []
        for pcp_set in self._sets.values():
            master = self._nodes.get(pcp_set.members[0])
            views.append(
                SetView(
                    pcp_set.head.set_id,
                    pcp_set.head.generation,
                    pcp_set.head.dp_rank,
                    pcp_set.state,
                    pcp_set.members,
                    master.registration.address if master else "",
                    pcp_set.head.pcp_size,
                    pcp_set.reason,
                    pcp_set.group[1],
                )
            )
        return sorted(views, key=lambda v: (v.model, v.dp_rank))

    @property
    def max_generation(self) -> int:
        """The highest generation issued or seen."""
        return self._max_generation

    @property
    def revision(self) -> int:
        """A number that changes whenever what `snapshot()` returns does (and only then grows): a caller
        that saved the snapshot at one revision need not save it again until this moves."""
        return self._revision

    def live_records(self) -> dict[str, tuple[str, str, str]]:
        """(role, address, model) of every live node, by node id: what the etcd store keeps of them."""
        return {
            node_id: (node.registration.role, node.registration.address, node.registration.model)
            for node_id, node in self._nodes.items()
            if node.alive
        }

    @property
    def restoring(self) -> bool:
        """True during the restore grace after a start, when no new sets are formed."""
        return not self._grace_over

    # --- snapshots ---------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """A JSON-able picture of the sets and generations, to make a restart faster (never required)."""
        return {
            "version": SNAPSHOT_VERSION,
            "max_generation": self._max_generation,
            "sets": [
                {
                    "role": s.group[0],
                    "model": s.group[1],
                    "broken": s.state is SetState.BROKEN,
                    "reason": s.reason,
                    "assignment": s.head_record,
                }
                for s in self._sets.values()
            ],
        }

    def _restore(self, snapshot: dict, now: float) -> None:
        if snapshot.get("version") != SNAPSHOT_VERSION:
            return
        # a counter above MAX_GENERATION (written before registrations were bounded) would issue
        # generations that do not fit the proto: it counts on from the stored sets instead
        stored = int(snapshot.get("max_generation", 0))
        if 0 <= stored <= MAX_GENERATION:
            self._max_generation = stored
        for entry in snapshot.get("sets", []):
            raw = dict(entry["assignment"])
            raw["pcp_ranks"] = tuple(raw["pcp_ranks"])
            raw["global_ranks"] = tuple(raw.get("global_ranks") or raw["pcp_ranks"])
            raw["member_node_ids"] = tuple(raw["member_node_ids"])
            head = Assignment(**raw)
            if not 0 < head.generation <= MAX_GENERATION:
                log.warning(
                    "stored set dropped: its generation is out of range; its slot is formed again",
                    extra={"set_id": head.set_id, "generation": head.generation, "max": MAX_GENERATION},
                )
                continue
            group = self._group(entry["role"], entry["model"])
            pcp_set = _Set((group.role, group.model), _all_ranks(head), reason=entry.get("reason", ""))
            if entry.get("broken"):
                pcp_set.state = SetState.BROKEN
                group.broken.add(head.dp_rank)
            else:
                pcp_set.restore_deadline = now + self.settings.restore_grace_s
                self._restoring[head.set_id] = pcp_set
                group.assembled = True
                group.broken.discard(head.dp_rank)
            self._sets[head.set_id] = pcp_set
            group.slots[head.dp_rank] = head.set_id
            self._max_generation = max(self._max_generation, head.generation)
        if not 0 <= stored <= MAX_GENERATION:
            log.warning(
                "stored max_generation is out of range; counting on from the stored sets' highest",
                extra={
                    "max_generation": stored,
                    "max": MAX_GENERATION,
                    "counting_from": self._max_generation,
                },
            )

    # --- internals ---------------------------------------------------------------------------------

    def _check_peers(self, group: _Group, reg: Registration) -> None:
        # one peer is enough: every live peer agreed with the group's config when it registered
        peer_id = next((nid for nid in group.live if nid != reg.node_id), None)
        if peer_id is None or reg.role == "kvstore":
            return
        peer = self._nodes[peer_id].registration
        assert group.config is not None and reg.engine_config is not None
        differences = config_differences(reg.engine_config, group.config)
        if reg.kv_fingerprint != group.kv_fingerprint:
            differences.append(f"kv_fingerprint={reg.kv_fingerprint!r} (peers: {group.kv_fingerprint!r})")
        if differences:
            raise FailedPrecondition(
                f"node {reg.node_id} disagrees with its {reg.role} peers of model "
                f"{reg.model or '(default)'!r} (e.g. {peer.node_id}): {'; '.join(differences)}. Every "
                f"{reg.role} node of one model must run the same engine config and KV fingerprint",
            )

    def _check_session(self, node: _Node, session: str, action: str) -> None:
        if node.registration.session != session:
            raise NodeIdInUse(
                f"node_id={node.registration.node_id!r} is bound to the live session of the node at "
                f"{node.registration.address}; another session cannot {action} it until that session ends "
                "(its lease expires or it deregisters). Give each node its own --node-id"
            )

    def _group(self, role: str, model: str) -> _Group:
        key = (role, model)
        if key not in self._groups:
            self._groups[key] = _Group(role, model)
        return self._groups[key]

    def _reset_group(self, group: _Group, reg: Registration) -> None:
        """The first live node of a group sets its config; sets formed by earlier nodes keep their slots."""
        group.config = reg.engine_config
        group.kv_fingerprint = reg.kv_fingerprint
        group.label = group_label(reg.model, reg.kv_fingerprint)
        group.assembled = any(self._sets[sid].state is not SetState.BROKEN for sid in group.slots.values())
        group.waiting_since = None

    def _live_node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered; call Register first")
        if not node.alive:
            raise NotFound(f"node {node_id!r} was declared dead (missed its lease); register again")
        return node

    def _node_state(self, node: _Node) -> NodeState:
        if not node.alive:
            return NodeState.DEAD
        if node.registration.role != "prefill":
            return NodeState.READY if node.ready else NodeState.POOLED
        if node.assignment is None:
            return NodeState.POOLED
        pcp_set = self._sets[node.assignment.set_id]
        return NodeState.READY if pcp_set.state is SetState.READY else NodeState.ASSIGNED

    def _adopt(self, node: _Node, group: _Group, carried: Assignment | None, now: float) -> Outgoing:
        """Gives a (re)registering prefill node its place in a set being restored, or tells it to stop
        running an assignment that is no longer valid."""
        node_id = node.registration.node_id
        out: Outgoing = []
        # a set being restored that expects this node, whatever the node carries
        expected = next((s for s in self._restoring.values() if node_id in s.members), None)
        # Any generation a node carries was issued once (validate bounds it): new sets count on past it, so a
        # set formed here never reuses the (set id, generation) of one that may still run.
        if carried is not None and carried.generation > self._max_generation:
            self._max_generation = carried.generation
            self._revision += 1
        if expected is not None and (
            carried is None
            or (
                0 <= carried.node_rank < len(expected.assignments)
                and carried == expected.assignments[carried.node_rank]
            )
        ):
            self._join(node, group, expected)
            return out
        if expected is not None:
            out += self._break(expected, f"member {node_id} came back with another assignment")
        if carried is None:
            return out
        assert group.config is not None
        problems = assignment_problems(carried, node_id, SetShape.of(group.config), group.label)
        current = self._sets.get(carried.set_id)
        if not problems and current is not None and current.state is not SetState.BROKEN:
            problems.append(f"slot {carried.set_id} is held by generation {current.head.generation}")
        elif not problems and current is not None and carried.generation <= current.head.generation:
            problems.append(f"generation {carried.generation} was dissolved ({current.reason})")
        others = [
            m for m in carried.member_node_ids if m != node_id and m in self._nodes and self._nodes[m].alive
        ]
        if not problems and others:
            problems.append(f"members {others} already came back without this assignment")
        if problems:
            reason = (
                f"assignment {carried.set_id} generation {carried.generation} is stale: {'; '.join(problems)}"
            )
            return [*out, (node_id, Stop(carried.set_id, carried.generation, reason))]
        restored = _Set(
            (group.role, group.model),
            _all_ranks(carried),
            restore_deadline=now + self.settings.restore_grace_s,
        )
        self._sets[carried.set_id] = restored
        self._revision += 1
        self._restoring[carried.set_id] = restored
        group.slots[carried.dp_rank] = carried.set_id
        group.broken.discard(carried.dp_rank)
        group.assembled = True
        self._join(node, group, restored)
        return out

    def _join(self, node: _Node, group: _Group, pcp_set: _Set) -> None:
        node_id = node.registration.node_id
        node.assignment = pcp_set.assignments[pcp_set.members.index(node_id)]
        group.pooled.pop(node_id, None)
        pcp_set.present.add(node_id)
        if pcp_set.present >= set(pcp_set.members):
            self._end_restore(pcp_set)
        self._update_readiness(pcp_set)

    def _end_restore(self, pcp_set: _Set) -> None:
        pcp_set.restore_deadline = None
        if self._restoring.get(pcp_set.head.set_id) is pcp_set:
            del self._restoring[pcp_set.head.set_id]

    def _update_readiness(self, pcp_set: _Set) -> None:
        complete = pcp_set.restore_deadline is None and pcp_set.ready >= set(pcp_set.members)
        pcp_set.state = SetState.READY if complete else SetState.STARTING

    def _end_grace_if_due(self, now: float) -> Outgoing:
        if self._grace_over:
            return []
        if now < self._grace_until and not (self._snapshot_restored and not self._restoring):
            return []
        self._grace_over = True
        out: Outgoing = []
        for group in list(self._groups.values()):
            out += self._assemble(group, now)
        return out

    def _assemble(self, group: _Group, now: float) -> Outgoing:
        """Forms every set the pool allows into the group's free slots."""
        if not self._grace_over or group.role != "prefill" or group.config is None:
            return []
        shape = SetShape.of(group.config)
        # counted, not listed: this runs at every registration and departure, and a walk over every slot
        # made a storm of them quadratic in the number of sets
        unfilled = shape.data_parallel_size - len(group.slots) + len(group.broken)
        needed = shape.nnodes if group.assembled else shape.nodes_required
        planned = []
        if unfilled > 0 and len(group.pooled) >= needed:
            empty = set(range(shape.data_parallel_size)) - group.slots.keys()
            free = sorted(dp for dp in group.broken | empty if dp < shape.data_parallel_size)
            pooled = sorted(group.pooled, key=group.pooled.__getitem__)[: len(free) * shape.nnodes]
            candidates = [self._candidate(node_id) for node_id in pooled]
            planned = plan_sets(
                candidates, shape, free, not group.assembled, self._max_generation + 1, group.label
            )
        out: Outgoing = []
        for plan in planned:
            pcp_set = _Set((group.role, group.model), plan.assignments)
            self._sets[plan.set_id] = pcp_set
            self._revision += 1
            group.slots[plan.dp_rank] = plan.set_id
            group.broken.discard(plan.dp_rank)
            self._max_generation = max(self._max_generation, plan.generation)
            for assignment in plan.assignments:
                node_id = assignment.member_node_ids[assignment.node_rank]
                self._join(self._nodes[node_id], group, pcp_set)
                out.append((node_id, Assign(assignment)))
        group.assembled = group.assembled or bool(planned)
        if unfilled > len(planned) and group.pooled:
            group.waiting_since = group.waiting_since if group.waiting_since is not None else now
        else:
            group.waiting_since = None
        return out

    def _candidate(self, node_id: str) -> Candidate:
        reg = self._nodes[node_id].registration
        assert reg.engine_config is not None
        return Candidate(node_id, reg.master_host, reg.engine_config.master_port)

    def _time_out_assembly(self, group: _Group, now: float) -> Outgoing:
        assert group.config is not None
        shape = SetShape.of(group.config)
        required = shape.nnodes if group.assembled else shape.nodes_required
        registered = len(group.pooled)
        reason = (
            f"{registered} {group.role} node(s) of model {group.model or '(default)'!r} pooled but a set "
            f"needs {required} (data_parallel_size={shape.data_parallel_size} x nnodes={shape.nnodes} for "
            f"the first assembly, nnodes for a re-form) after {self.settings.assembly_timeout_s:g} s; "
            "still waiting"
        )
        group.waiting_since = now
        return [(nid, AssemblyTimedOut(registered, required, reason)) for nid in group.pooled]

    def _break(self, pcp_set: _Set, reason: str) -> Outgoing:
        """Takes a set out of routing at once; every member is told to stop and live ones are pooled."""
        if pcp_set.state is SetState.BROKEN:
            return []
        pcp_set.state = SetState.BROKEN
        pcp_set.reason = reason
        self._revision += 1
        self._end_restore(pcp_set)
        group = self._groups[pcp_set.group]
        out: Outgoing = []
        head = pcp_set.head
        if group.slots.get(head.dp_rank) == head.set_id:
            group.broken.add(head.dp_rank)
        for node_id in pcp_set.members:
            node = self._nodes.get(node_id)
            if node is None or node.assignment is None or node.assignment.set_id != head.set_id:
                continue
            node.assignment = None
            out.append((node_id, Stop(head.set_id, head.generation, reason)))
            if node.alive:
                group.pooled[node_id] = node.seq
        return out

    def _kill(self, node: _Node, reason: str, now: float) -> Outgoing:
        node.alive = False
        return self._leave(node, reason, now)

    def _remove(self, node: _Node, reason: str, now: float) -> Outgoing:
        del self._nodes[node.registration.node_id]
        return self._leave(node, reason, now)

    def _leave(self, node: _Node, reason: str, now: float) -> Outgoing:
        node_id = node.registration.node_id
        group = self._groups[node.group]
        group.live.pop(node_id, None)
        group.pooled.pop(node_id, None)
        out: Outgoing = []
        if node.assignment is not None:
            out += self._break(self._sets[node.assignment.set_id], reason)
            group.pooled.pop(node_id, None)
        if not group.pooled:
            group.waiting_since = None
        return out + self._assemble(group, now)
