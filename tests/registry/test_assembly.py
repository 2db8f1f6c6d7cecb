"""Set forming as pure functions: shapes, ranks, slots and generations, for any pool and any shape."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from pcpstack.common.config import EngineConfig
from pcpstack.registry.assembly import (
    Candidate,
    SetShape,
    assignment_problems,
    config_differences,
    global_ranks_of,
    group_label,
    pcp_ranks_of,
    plan_sets,
    set_id_for,
)

LABEL = group_label("models/llama-3-8b", "fp")


def _pool(n: int) -> list[Candidate]:
    return [Candidate(f"node-{i}", f"10.0.0.{i}", 7001) for i in range(n)]


def test_first_assembly_waits_for_dp_times_nnodes_nodes():
    shape = SetShape(nnodes=2, pcp_size=4, data_parallel_size=2)
    assert plan_sets(_pool(3), shape, [0, 1], True, 1, LABEL) == []
    planned = plan_sets(_pool(4), shape, [0, 1], True, 1, LABEL)
    assert [p.dp_rank for p in planned] == [0, 1]
    assert [p.generation for p in planned] == [1, 2]


def test_consecutive_nodes_form_a_set_with_master_first_and_headless_others():
    shape = SetShape(nnodes=2, pcp_size=4, data_parallel_size=2)
    first, second = plan_sets(_pool(4), shape, [0, 1], True, 7, LABEL)
    master, headless = first.assignments
    assert master.member_node_ids == ("node-0", "node-1")
    assert (master.node_rank, master.headless, master.pcp_ranks) == (0, False, (0, 1))
    assert (headless.node_rank, headless.headless, headless.pcp_ranks) == (1, True, (2, 3))
    assert headless.master_addr == "10.0.0.0" and headless.master_port == 7001
    assert second.assignments[0].master_addr == "10.0.0.2"
    assert first.set_id == set_id_for(LABEL, 0) and second.set_id == set_id_for(LABEL, 1)


def test_a_reform_needs_only_nnodes_nodes_and_fills_the_lowest_free_slot():
    shape = SetShape(nnodes=2, pcp_size=2, data_parallel_size=3)
    (planned,) = plan_sets(_pool(3), shape, [2, 1], False, 5, LABEL)
    assert planned.dp_rank == 1 and planned.generation == 5


def test_config_differences_name_the_keys_and_values():
    ours = EngineConfig(nnodes=2, prefill_context_parallel_size=2, tensor_parallel_size=2)
    peers = EngineConfig(nnodes=1, prefill_context_parallel_size=2)
    assert config_differences(ours, peers) == [
        "tensor_parallel_size=2 (peers: 1)",
        "nnodes=2 (peers: 1)",
    ]


def test_assignment_problems_catch_a_node_that_is_not_the_named_member():
    shape = SetShape(nnodes=2, pcp_size=2, data_parallel_size=1)
    (planned,) = plan_sets(_pool(2), shape, [0], True, 1, LABEL)
    assert assignment_problems(planned.assignments[1], "node-1", shape, LABEL) == []
    assert assignment_problems(planned.assignments[1], "node-0", shape, LABEL)
    assert assignment_problems(planned.assignments[0], "node-0", SetShape(2, 4, 1), LABEL)


def test_a_node_runs_the_tp_ranks_of_each_of_its_pcp_ranks():
    # seed 000's shape scaled down: tp 3, pcp 2, nnodes 2 -> three consecutive global ranks per node
    shape = SetShape(nnodes=2, pcp_size=2, data_parallel_size=1, tp_size=3)
    (planned,) = plan_sets(_pool(2), shape, [0], True, 1, LABEL)
    master, headless = planned.assignments
    assert (master.tp_size, master.pcp_ranks, master.global_ranks) == (3, (0,), (0, 1, 2))
    assert (headless.pcp_ranks, headless.global_ranks) == ((1,), (3, 4, 5))
    assert global_ranks_of((2, 3), 2) == (4, 5, 6, 7)


def test_assignment_problems_catch_a_carried_assignment_with_another_tp():
    shape = SetShape(nnodes=2, pcp_size=2, data_parallel_size=1, tp_size=2)
    (planned,) = plan_sets(_pool(2), shape, [0], True, 1, LABEL)
    headless = planned.assignments[1]
    assert assignment_problems(headless, "node-1", shape, LABEL) == []
    (problem,) = assignment_problems(headless, "node-1", SetShape(2, 2, 1, tp_size=3), LABEL)
    assert "tp_size=2" in problem and "tensor_parallel_size=3" in problem
    shifted = replace(headless, global_ranks=(1, 2))
    (problem,) = assignment_problems(shifted, "node-1", shape, LABEL)
    assert "global_ranks=[1, 2]" in problem


@st.composite
def _shapes(draw) -> SetShape:
    nnodes = draw(st.integers(1, 4))
    pcp_size = nnodes * draw(st.integers(1, 3))
    return SetShape(nnodes, pcp_size, draw(st.integers(1, 4)), tp_size=draw(st.integers(1, 4)))


@given(
    shape=_shapes(),
    pool_size=st.integers(0, 20),
    free=st.sets(st.integers(0, 3), max_size=4),
    first=st.booleans(),
    next_generation=st.integers(1, 1000),
    order=st.randoms(use_true_random=False),
)
def test_any_pool_yields_valid_non_overlapping_sets(shape, pool_size, free, first, next_generation, order):
    pool = _pool(pool_size)
    order.shuffle(pool)
    free_slots = sorted(dp for dp in free if dp < shape.data_parallel_size)
    planned = plan_sets(pool, shape, free_slots, first, next_generation, LABEL)
    needed = shape.nodes_required if first else shape.nnodes
    if len(pool) < needed or not free_slots:
        assert planned == []
        return
    assert len(planned) == min(len(free_slots), len(pool) // shape.nnodes)
    members = [m for p in planned for m in p.assignments[0].member_node_ids]
    # registration order: the first nodes of the pool, each in exactly one set
    assert members == [c.node_id for c in pool[: len(members)]]
    assert [p.generation for p in planned] == list(range(next_generation, next_generation + len(planned)))
    assert len({p.dp_rank for p in planned}) == len(planned) and {p.dp_rank for p in planned} <= set(free)
    for p in planned:
        ranks = sorted(r for a in p.assignments for r in a.pcp_ranks)
        assert ranks == list(range(shape.pcp_size))
        # every rank of the set's tp x pcp world runs on exactly one node, in node order
        world = [r for a in p.assignments for r in a.global_ranks]
        assert world == list(range(shape.tp_size * shape.pcp_size))
        for a in p.assignments:
            node_id = a.member_node_ids[a.node_rank]
            assert assignment_problems(a, node_id, shape, LABEL) == []
            assert a.pcp_ranks == pcp_ranks_of(a.node_rank, shape.pcp_size, shape.nnodes)
            assert a.master_addr == p.assignments[0].master_addr


def test_assignment_problems_name_long_lists_briefly():
    shape = SetShape(nnodes=2, pcp_size=2, data_parallel_size=1, tp_size=2)
    (planned,) = plan_sets(_pool(2), shape, [0], True, 1, LABEL)
    bloated = replace(planned.assignments[1], pcp_ranks=(7,) * 200_000)
    problems = assignment_problems(bloated, "node-1", shape, LABEL)
    assert "pcp_ranks=[7, 7, 7, 7, 7, 7, 7, 7, ... (200000 in all)]" in problems[0]
    assert len(problems) == 2 and all(len(problem) < 300 for problem in problems)  # and global_ranks
