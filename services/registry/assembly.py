"""How PCP sets are formed: pure functions from pooled nodes and a group's shape to assignments.

No gRPC, no clocks, no state: `membership.py` decides *when* to form sets and keeps the books; this module
decides *what* a set looks like (seed 000's rules): each `nnodes` consecutive pooled nodes, in registration
order, form one set; the first is the master (`node_rank = 0`), the others are headless; every node hosts
`pcp_size / nnodes` consecutive PCP ranks and, for each, its `tp_size` TP ranks, numbered in the set's world
as `pcp_rank x tp_size + tp_rank` (the layout of pcpstack.engine.parallel.ParallelLayout); `master_addr` is
the master's host and `master_port` its configured port.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pcpstack.common.config import EngineConfig

# Engine-config keys on which peers of one role and model must agree (master_port is the master's own
# choice; engine_type is informational).
AGREED_KEYS = (
    "tensor_parallel_size",
    "data_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
    "nnodes",
    "block_size",
    "cp_kv_cache_interleave_size",
    "kv_transfer_mode",
)


@dataclass(frozen=True)
class Assignment:
    """A node's place in a PCP set (the core's form of the proto Assignment)."""

    set_id: str
    generation: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    headless: bool
    dp_rank: int
    pcp_size: int
    pcp_ranks: tuple[int, ...]
    member_node_ids: tuple[str, ...]
    # TP ranks per PCP rank, and the global ranks (in the set's world of tp x pcp) this node runs.
    tp_size: int = 1
    global_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Candidate:
    """A pooled node that may join a set: its identity and where it would serve as master."""

    node_id: str
    master_host: str
    master_port: int


@dataclass(frozen=True)
class SetShape:
    """What every set of one group looks like, from the group's (agreed) engine config."""

    nnodes: int
    pcp_size: int
    data_parallel_size: int
    tp_size: int = 1

    @classmethod
    def of(cls, config: EngineConfig) -> SetShape:
        """The shape a validated config asks for."""
        return cls(
            config.nnodes,
            config.prefill_context_parallel_size,
            config.data_parallel_size,
            config.tensor_parallel_size,
        )

    @property
    def nodes_required(self) -> int:
        """Nodes that fill every data-parallel set: dp x nnodes."""
        return self.nnodes * self.data_parallel_size


@dataclass(frozen=True)
class PlannedSet:
    """A set to form: its slot, generation and members' assignments in node_rank order."""

    set_id: str
    dp_rank: int
    generation: int
    assignments: tuple[Assignment, ...]


def group_label(model: str, kv_fingerprint: str) -> str:
    """A short, readable, stable prefix for the set ids of one (model, fingerprint) group."""
    base = re.sub(r"[^a-z0-9]+", "-", model.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")[:24]
    digest = hashlib.sha256(f"{model}\0{kv_fingerprint}".encode()).hexdigest()[:6]
    return f"{base or 'default'}-{digest}"


def set_id_for(label: str, dp_rank: int) -> str:
    """The id of a group's set in one data-parallel slot; it survives re-forms (the generation changes)."""
    return f"{label}-dp{dp_rank}"


def pcp_ranks_of(node_rank: int, pcp_size: int, nnodes: int) -> tuple[int, ...]:
    """PCP ranks hosted by the node at node_rank: pcp_size / nnodes consecutive ranks."""
    per_node = pcp_size // nnodes
    return tuple(range(node_rank * per_node, (node_rank + 1) * per_node))


def global_ranks_of(pcp_ranks: Sequence[int], tp_size: int) -> tuple[int, ...]:
    """Global ranks of the TP ranks of `pcp_ranks`: `pcp_rank x tp_size + tp_rank`, TP ranks of one PCP
    rank consecutive (so a node runs tp x pcp / nnodes consecutive global ranks)."""
    return tuple(p * tp_size + t for p in pcp_ranks for t in range(tp_size))


def make_assignments(
    set_id: str, generation: int, dp_rank: int, members: Sequence[Candidate], shape: SetShape
) -> tuple[Assignment, ...]:
    """The assignments of one set whose members are given in node_rank order."""
    if len(members) != shape.nnodes:
        raise ValueError(f"a set needs nnodes={shape.nnodes} members, got {len(members)}")
    master = members[0]
    member_ids = tuple(m.node_id for m in members)
    ranks = [pcp_ranks_of(rank, shape.pcp_size, shape.nnodes) for rank in range(shape.nnodes)]
    return tuple(
        Assignment(
            set_id=set_id,
            generation=generation,
            node_rank=rank,
            nnodes=shape.nnodes,
            master_addr=master.master_host,
            master_port=master.master_port,
            headless=rank != 0,
            dp_rank=dp_rank,
            pcp_size=shape.pcp_size,
            pcp_ranks=ranks[rank],
            member_node_ids=member_ids,
            tp_size=shape.tp_size,
            global_ranks=global_ranks_of(ranks[rank], shape.tp_size),
        )
        for rank in range(shape.nnodes)
    )


def plan_sets(
    pooled: Sequence[Candidate],
    shape: SetShape,
    free_dp_ranks: Sequence[int],
    first_assembly: bool,
    next_generation: int,
    label: str,
) -> list[PlannedSet]:
    """Sets to form now from `pooled` (in registration order) into the free data-parallel slots.

    The first assembly of a group waits until all dp x nnodes nodes are there and forms every set at once
    (seed 000); later, a broken set's slot is re-formed as soon as nnodes nodes are pooled. Each set gets
    its own generation, counting up from next_generation.
    """
    needed = shape.nodes_required if first_assembly else shape.nnodes
    if not free_dp_ranks or len(pooled) < needed:
        return []
    count = min(len(free_dp_ranks), len(pooled) // shape.nnodes)
    planned = []
    for index, dp_rank in enumerate(sorted(free_dp_ranks)[:count]):
        members = pooled[index * shape.nnodes : (index + 1) * shape.nnodes]
        set_id = set_id_for(label, dp_rank)
        generation = next_generation + index
        planned.append(
            PlannedSet(
                set_id, dp_rank, generation, make_assignments(set_id, generation, dp_rank, members, shape)
            )
        )
    return planned


def _brief(values: Sequence, shown: int = 8) -> str:
    """A list for a message: whole when short, else its first items and how many there are."""
    if len(values) <= shown:
        return str(list(values))
    return f"[{', '.join(map(repr, values[:shown]))}, ... ({len(values)} in all)]"


def assignment_problems(assignment: Assignment, node_id: str, shape: SetShape, label: str) -> list[str]:
    """Why an assignment a node carries cannot belong to its group (empty when it can), e.g. after a
    registry restart; every field is checked against the rules that formed it."""
    problems = []
    if assignment.nnodes != shape.nnodes or len(assignment.member_node_ids) != shape.nnodes:
        problems.append(
            f"nnodes={assignment.nnodes} with {len(assignment.member_node_ids)} members but the "
            f"group runs nnodes={shape.nnodes}"
        )
    if assignment.pcp_size != shape.pcp_size:
        problems.append(f"pcp_size={assignment.pcp_size} but the group runs {shape.pcp_size}")
    if assignment.dp_rank >= shape.data_parallel_size:
        problems.append(
            f"dp_rank={assignment.dp_rank} is outside data_parallel_size={shape.data_parallel_size}"
        )
    if assignment.set_id != set_id_for(label, assignment.dp_rank):
        problems.append(f"set_id={assignment.set_id!r} is not the id of dp_rank {assignment.dp_rank}")
    if assignment.generation < 1:
        problems.append("generation is 0")
    members = assignment.member_node_ids
    if not (0 <= assignment.node_rank < len(members) and members[assignment.node_rank] == node_id):
        problems.append(f"node {node_id!r} is not member {assignment.node_rank} of {_brief(members)}")
    if len(set(members)) != len(members):
        problems.append(f"members repeat: {_brief(members)}")
    if assignment.headless != (assignment.node_rank != 0):
        problems.append(f"headless={assignment.headless} with node_rank={assignment.node_rank}")
    if shape.nnodes and assignment.pcp_ranks != pcp_ranks_of(
        assignment.node_rank, shape.pcp_size, shape.nnodes
    ):
        problems.append(
            f"pcp_ranks={_brief(assignment.pcp_ranks)} do not match node_rank {assignment.node_rank}"
        )
    if assignment.tp_size != shape.tp_size:
        problems.append(
            f"tp_size={assignment.tp_size} but the group runs tensor_parallel_size={shape.tp_size}"
        )
    elif assignment.global_ranks != global_ranks_of(assignment.pcp_ranks, shape.tp_size):
        problems.append(
            f"global_ranks={_brief(assignment.global_ranks)} are not the TP ranks of pcp_ranks "
            f"{_brief(assignment.pcp_ranks)} with tp_size={shape.tp_size}"
        )
    return problems


def config_differences(config: EngineConfig, peer: EngineConfig) -> list[str]:
    """Agreed keys on which config differs from a peer's, as `key=value (peers: value)`."""
    return [
        f"{key}={getattr(config, key)!r} (peers: {getattr(peer, key)!r})"
        for key in AGREED_KEYS
        if getattr(config, key) != getattr(peer, key)
    ]
