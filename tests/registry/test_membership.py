"""The registry's state machine with a controlled clock: registration rules, assembly, leases, re-forms,
fencing, restarts and snapshots; plus a property test over random registrations and failures."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpstack.common.config import EngineConfig
from pcpstack.common.errors import FailedPrecondition, InvalidArgument, ServiceError
from pcpstack.registry.membership import (
    Ack,
    AssemblyTimedOut,
    Assign,
    Membership,
    NodeIdInUse,
    NodeState,
    Refusal,
    Registration,
    SetState,
    Settings,
    Stop,
)

LEASE = 1.0
SETTINGS = Settings(lease_s=LEASE, assembly_timeout_s=5.0, restore_grace_s=0.0)


def _config(**overrides) -> EngineConfig:
    values = {"data_parallel_size": 2, "nnodes": 2, "prefill_context_parallel_size": 2, **overrides}
    return EngineConfig(**values).validate()


DECODE = EngineConfig(role="decode").validate()


def _prefill(node_id: str, config: EngineConfig | None = None, **fields) -> Registration:
    index = int(node_id.rsplit("-", 1)[-1])
    return Registration(
        node_id=node_id,
        role="prefill",
        address=f"10.0.0.{index}:8000",
        engine_config=config or _config(),
        kv_fingerprint="fp",
        **fields,
    )


def _assigns(out) -> dict[str, Assign]:
    return {node_id: c for node_id, c in out if isinstance(c, Assign)}


def _ready_all(m: Membership, now: float) -> None:
    for view in m.nodes(now):
        if view.assignment is not None:
            a = view.assignment
            m.report_status(view.node_id, a.set_id, a.generation, True, "", now)


def _full_cluster(m: Membership, count: int = 4, now: float = 0.0) -> dict[str, object]:
    held = {}
    for i in range(count):
        assignment, _ = m.register(_prefill(f"node-{i}"), now)
        held[f"node-{i}"] = assignment
    return {v.node_id: v.assignment for v in m.nodes(now)}


def test_no_set_forms_until_dp_times_nnodes_nodes_registered():
    m = Membership(SETTINGS, 0.0)
    for i in range(3):
        assignment, out = m.register(_prefill(f"node-{i}"), 0.0)
        assert assignment is None and out == []
    assignment, out = m.register(_prefill("node-3"), 0.0)
    assert assignment is not None and assignment.node_rank == 1 and assignment.dp_rank == 1
    assert set(_assigns(out)) == {"node-0", "node-1", "node-2"}, "the registrant learns it from the response"
    assert [s.state for s in m.sets()] == [SetState.STARTING, SetState.STARTING]


def test_set_is_routable_only_after_every_rank_reported_ready():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    a0 = held["node-0"]
    m.report_status("node-0", a0.set_id, a0.generation, True, "", 0.0)
    assert m.resolve().prefill_sets == ()
    a1 = held["node-1"]
    m.report_status("node-1", a1.set_id, a1.generation, True, "", 0.0)
    (endpoint,) = m.resolve().prefill_sets
    assert (endpoint.set_id, endpoint.address, endpoint.pcp_size) == (a0.set_id, "10.0.0.0:8000", 2)


@pytest.mark.parametrize(
    ("registration", "kind", "names"),
    [
        (Registration("", "prefill", "h:1", engine_config=_config()), InvalidArgument, "node_id"),
        (Registration("n", "", "h:1"), InvalidArgument, "role"),
        (Registration("n", "decode", "nohost", engine_config=DECODE), InvalidArgument, "address"),
        (
            Registration(
                "n", "prefill", "h:1", device_count=1, engine_config=_config(tensor_parallel_size=2)
            ),
            FailedPrecondition,
            "device_count",
        ),
    ],
)
def test_bad_registrations_are_refused_naming_the_field(registration, kind, names):
    with pytest.raises(ServiceError) as caught:
        Membership(SETTINGS, 0.0).register(registration, 0.0)
    assert type(caught.value) is kind and names in str(caught.value)


def test_a_node_disagreeing_with_its_peers_is_refused_naming_the_difference():
    m = Membership(SETTINGS, 0.0)
    m.register(_prefill("node-0"), 0.0)
    with pytest.raises(FailedPrecondition) as caught:
        m.register(_prefill("node-1", _config(prefill_context_parallel_size=4)), 0.0)
    assert "prefill_context_parallel_size=4 (peers: 2)" in str(caught.value)
    with pytest.raises(FailedPrecondition, match="kv_fingerprint='other'"):
        m.register(
            Registration("node-2", "prefill", "h:1", engine_config=_config(), kv_fingerprint="other"), 0.0
        )
    # another model is another group: no conflict
    m.register(_prefill("node-3", _config(model="other", nnodes=1, prefill_context_parallel_size=1)), 0.0)


def test_reregistering_with_the_same_identity_returns_the_same_assignment():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    again, out = m.register(_prefill("node-2"), 0.5)
    assert again == held["node-2"] and out == []


def test_a_missed_lease_breaks_the_whole_set_and_stops_survivors_then_it_reforms():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    _ready_all(m, 0.0)
    for node_id in ("node-0", "node-2", "node-3"):
        m.heartbeat(node_id, held[node_id].generation, 0, 0.9)
    out = m.tick(1.5)
    stops = {node_id: c for node_id, c in out if isinstance(c, Stop)}
    assert set(stops) == {"node-0", "node-1"} and "node-1 missed its lease" in stops["node-0"].reason
    assert [e.set_id for e in m.resolve().prefill_sets] == [held["node-2"].set_id]
    states = {v.node_id: v.state for v in m.nodes(1.5)}
    assert states == {
        "node-0": NodeState.POOLED,
        "node-1": NodeState.DEAD,
        "node-2": NodeState.READY,
        "node-3": NodeState.READY,
    }
    assignment, out = m.register(_prefill("node-4"), 1.6)
    assert assignment.set_id == held["node-0"].set_id
    assert assignment.generation > max(a.generation for a in held.values())
    assert assignment.member_node_ids == ("node-0", "node-4")
    assert _assigns(out)["node-0"].assignment.node_rank == 0


def test_time_the_registry_could_not_listen_is_excused_from_leases_but_later_silence_is_not():
    m = Membership(SETTINGS, 0.0)
    _full_cluster(m)
    _ready_all(m, 0.0)
    # the registry's loop was held up from 0.5 s to 3.0 s: heartbeats sent meanwhile were not read
    m.excuse(2.5, 3.0)
    assert m.tick(3.0) == []
    assert {v.state for v in m.nodes(3.0)} == {NodeState.READY}
    # silence after the excused time counts as before
    stops = [c for _, c in m.tick(3.6) if isinstance(c, Stop)]
    assert len(stops) == 4 and all("missed its lease" in stop.reason for stop in stops)


def test_stale_generations_are_refused_but_renew_the_lease():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    a = held["node-0"]
    assert m.heartbeat("node-0", a.generation, 3, 0.1) == Ack(a.generation)
    refusal = m.heartbeat("node-0", a.generation + 10, 0, 0.9)
    assert isinstance(refusal, Refusal) and refusal.current_generation == a.generation
    reply, out = m.report_status(
        "node-0", a.set_id, a.generation - 1 if a.generation > 1 else 99, True, "", 0.9
    )
    assert isinstance(reply, Refusal) and out == []
    assert not [
        c for _, c in m.tick(1.5) if isinstance(c, Stop) and c.set_id == a.set_id and "node-0" in c.reason
    ]


def test_a_rank_failure_breaks_its_set():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    a = held["node-1"]
    _, out = m.report_status("node-1", a.set_id, a.generation, False, "nccl init failed", 0.1)
    assert {n for n, c in out if isinstance(c, Stop)} == {"node-0", "node-1"}
    assert next(v.last_error for v in m.nodes(0.1) if v.node_id == "node-1") == "nccl init failed"
    # the pooled pair re-forms the slot at once, under a new generation
    assert {c.assignment.generation for c in _assigns(out).values()} == {m.max_generation}


def test_an_incomplete_assembly_times_out_and_its_nodes_are_told():
    m = Membership(SETTINGS, 0.0)
    m.register(_prefill("node-0"), 0.0)
    m.heartbeat("node-0", 0, 0, 4.0)
    out = m.tick(5.0)
    assert [(n, type(c)) for n, c in out] == [("node-0", AssemblyTimedOut)]
    assert out[0][1].registered == 1 and out[0][1].required == 4


def test_deregistering_a_member_dissolves_its_set_at_once():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    removed, out = m.deregister("node-3", 0.1)
    assert removed and {n for n, c in out if isinstance(c, Stop)} == {"node-2"}
    assert m.deregister("node-3", 0.1) == (False, [])
    assert held["node-2"].set_id not in {s.set_id for s in m.sets() if s.state is not SetState.BROKEN}


def test_decode_and_kvstore_are_routable_once_registered_and_can_leave_routing():
    m = Membership(SETTINGS, 0.0)
    m.register(
        Registration("dec-1", "decode", "10.0.1.1:9000", engine_config=DECODE, kv_fingerprint="fp"), 0.0
    )
    m.register(Registration("kv-1", "kvstore", "10.0.2.1:9100"), 0.0)
    found = m.resolve()
    assert [e.node_id for e in found.decode] == ["dec-1"] and [e.node_id for e in found.kvstore] == ["kv-1"]
    m.report_status("kv-1", "", 0, False, "", 0.1)
    assert m.resolve().kvstore == ()


def test_a_live_node_id_is_bound_to_its_session_until_that_session_ends():
    m = Membership(SETTINGS, 0.0)
    real = Registration("dec-0", "decode", "10.0.1.1:9000", engine_config=DECODE, session="real")
    impostor = replace(real, address="10.0.9.9:9000", session="impostor")
    m.register(real, 0.0)
    with pytest.raises(NodeIdInUse, match="'dec-0' is bound to the live session"):
        m.register(impostor, 0.1)
    with pytest.raises(NodeIdInUse):
        m.open_session("dec-0", 0.1, "impostor")
    with pytest.raises(NodeIdInUse):
        m.deregister("dec-0", 0.1, "impostor")
    assert [e.address for e in m.resolve().decode] == ["10.0.1.1:9000"]
    m.register(real, 0.5)  # its own session re-registers freely
    m.tick(0.5 + LEASE + 0.1)  # then goes silent: the session has ended
    m.register(impostor, 1.7)
    assert [e.address for e in m.resolve().decode] == ["10.0.9.9:9000"]
    m.deregister("dec-0", 1.8, "impostor")
    m.register(real, 1.9)  # a deregistered id is free at once
    assert [e.address for e in m.resolve().decode] == ["10.0.1.1:9000"]


def test_a_started_registry_is_warming_until_live_nodes_had_time_to_come_back():
    m = Membership(Settings(lease_s=1.0, restore_grace_s=0.0, warmup_s=5.0), 100.0)
    assert m.warming(100.0) and m.warming(104.9)
    assert not m.warming(105.0)
    restoring = Membership(Settings(lease_s=1.0, restore_grace_s=8.0, warmup_s=5.0), 0.0)
    restoring.tick(6.0)
    assert restoring.warming(6.0)  # the restore grace is not over yet


def _restart(
    m: Membership, held: dict, now: float, snapshot: dict | None = None, grace: float = 3.0
) -> Membership:
    fresh = Membership(Settings(lease_s=LEASE, assembly_timeout_s=5.0, restore_grace_s=grace), now, snapshot)
    for node_id, assignment in held.items():
        got, _ = fresh.register(_prefill(node_id, current_assignment=assignment), now)
        assert got == assignment, f"{node_id} must get its assignment back"
    return fresh


def test_after_a_restart_nodes_carrying_assignments_rebuild_the_same_sets():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    _ready_all(m, 0.0)
    fresh = _restart(m, held, 10.0)
    assert all(s.state is SetState.STARTING for s in fresh.sets())
    _ready_all(fresh, 10.1)
    assert len(fresh.resolve().prefill_sets) == 2
    # a new set formed later gets a generation above every carried one
    fresh.register(_prefill("node-4"), 10.2)
    fresh.deregister("node-0", 10.2)
    assignment, _ = fresh.register(_prefill("node-5"), 10.3)
    assert assignment is None  # still in the grace: nothing new is formed
    for view in fresh.nodes(13.0):
        fresh.heartbeat(view.node_id, 0, 0, 13.0)
    new = _assigns(fresh.tick(13.1))
    assert new and min(c.assignment.generation for c in new.values()) > max(
        a.generation for a in held.values()
    )


def test_spares_registering_first_after_a_restart_do_not_steal_restored_slots():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    m.register(_prefill("node-4"), 0.0)
    m.register(_prefill("node-5"), 0.0)
    fresh = Membership(Settings(lease_s=LEASE, restore_grace_s=3.0), 10.0)
    fresh.register(_prefill("node-4"), 10.0)
    fresh.register(_prefill("node-5"), 10.0)
    for node_id, assignment in held.items():
        got, out = fresh.register(_prefill(node_id, current_assignment=assignment), 10.5)
        assert got == assignment and not _assigns(out)


def test_a_stale_carried_assignment_is_told_to_stop():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    for node_id in ("node-0", "node-2", "node-3"):
        m.heartbeat(node_id, held[node_id].generation, 0, 0.9)
    m.tick(1.5)  # node-1 dies, its set breaks
    got, out = m.register(_prefill("node-1", current_assignment=held["node-1"]), 1.6)
    stops = [c for n, c in out if n == "node-1" and isinstance(c, Stop)]
    assert [s.generation for s in stops] == [held["node-1"].generation] and "stale" in stops[0].reason
    # back in the pool beside node-0, it is re-formed into a newer generation at once
    assert got is not None and got.generation > held["node-1"].generation


def test_a_snapshot_ends_the_restore_grace_once_its_members_are_back():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    snapshot = m.snapshot()
    fresh = Membership(Settings(lease_s=LEASE, restore_grace_s=30.0), 10.0, snapshot)
    assert fresh.restoring and fresh.max_generation == m.max_generation
    for node_id, assignment in held.items():
        got, _ = fresh.register(_prefill(node_id), 10.0)  # even without carrying it
        assert got == assignment
    assert not fresh.restoring


def test_restored_sets_whose_members_do_not_return_are_dissolved():
    m = Membership(SETTINGS, 0.0)
    held = _full_cluster(m)
    fresh = Membership(Settings(lease_s=10.0, restore_grace_s=3.0), 10.0)
    fresh.register(_prefill("node-0", current_assignment=held["node-0"]), 10.0)
    out = fresh.tick(13.1)
    assert ("node-0", Stop) in [(n, type(c)) for n, c in out]
    assert {v.node_id: v.state for v in fresh.nodes(13.1)} == {"node-0": NodeState.POOLED}


# --- property: any registration order and any failure sequence -------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["register", "silence", "deregister", "ready", "fail", "tick"]),
        st.integers(0, 9),
    ),
    max_size=60,
)


def _check_invariants(m: Membership, now: float, formations: dict[int, tuple[str, tuple[str, ...]]]) -> None:
    views = {v.node_id: v for v in m.nodes(now)}
    live_sets = [s for s in m.sets() if s.state is not SetState.BROKEN]
    seen_members: set[str] = set()
    for s in live_sets:
        assert not seen_members & set(s.member_node_ids), "a node sits in two sets"
        seen_members |= set(s.member_node_ids)
        assert len(s.member_node_ids) == 2 and s.dp_rank < 2
        for rank, node_id in enumerate(s.member_node_ids):
            view = views[node_id]
            assert view.state is not NodeState.DEAD
            a = view.assignment
            assert (a.set_id, a.generation, a.node_rank, a.headless) == (
                s.set_id,
                s.generation,
                rank,
                rank != 0,
            )
            assert a.pcp_ranks == (rank,)
        # a generation names one formation only: the same set, the same members, for as long as it lives
        formation = (s.set_id, s.member_node_ids)
        assert formations.setdefault(s.generation, formation) == formation
    assert len({s.dp_rank for s in live_sets}) == len(live_sets)
    assert len({s.generation for s in live_sets}) == len(live_sets)
    for node_id, view in views.items():
        if node_id not in seen_members:
            assert view.assignment is None
    ready_ids = {e.set_id for e in m.resolve().prefill_sets}
    assert ready_ids == {s.set_id for s in live_sets if s.state is SetState.READY}
    pooled = [v for v in views.values() if v.state is NodeState.POOLED]
    # nothing is left waiting that could have formed a set
    assert not (len(live_sets) < 2 and len(pooled) >= 4)
    assert not (len(live_sets) == 1 and len(pooled) >= 2)


def _assigned_and_alive(view) -> bool:
    return view is not None and view.state is not NodeState.DEAD and view.assignment is not None


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_any_registration_order_and_failure_sequence_keeps_sets_valid(ops):
    m = Membership(SETTINGS, 0.0)
    now = 0.0
    silent: set[str] = set()
    formations: dict[int, tuple[str, tuple[str, ...]]] = {}
    max_generation = 0
    for op, index in ops:
        node_id = f"node-{index}"
        now += 0.3
        views = {v.node_id: v for v in m.nodes(now)}
        if op == "register":
            silent.discard(node_id)
            m.register(_prefill(node_id), now)
        elif op == "silence":
            silent.add(node_id)
        elif op == "deregister":
            m.deregister(node_id, now)
        elif op in ("ready", "fail") and _assigned_and_alive(views.get(node_id)):
            a = views[node_id].assignment
            m.report_status(
                node_id, a.set_id, a.generation, op == "ready", "boom" if op == "fail" else "", now
            )
        for view in m.nodes(now):
            if view.node_id not in silent and view.state is not NodeState.DEAD:
                m.heartbeat(view.node_id, view.assignment.generation if view.assignment else 0, 0, now)
        m.tick(now)
        _check_invariants(m, now, formations)
        assert m.max_generation >= max_generation
        max_generation = m.max_generation


def test_seed_000_example_registers_with_16_devices_a_node_and_forms_one_32_rank_set():
    """Seed 000's own shape (tp 16, pcp 2, nnodes 2): each node offers 16 devices, runs one PCP rank's 16 TP
    ranks, and the set's world is the 32 ranks numbered pcp_rank x 16 + tp_rank; 15 devices are refused."""
    seed = _config(data_parallel_size=1, tensor_parallel_size=16)
    with pytest.raises(FailedPrecondition, match="device_count=15"):
        Membership(SETTINGS, 0.0).register(_prefill("node-9", seed, device_count=15), 0.0)
    m = Membership(SETTINGS, 0.0)
    m.register(_prefill("node-0", seed, device_count=16), 0.0)
    m.register(_prefill("node-1", seed, device_count=16), 0.0)
    held = {v.node_id: v.assignment for v in m.nodes(0.0)}
    assert [held[n].tp_size for n in ("node-0", "node-1")] == [16, 16]
    assert held["node-0"].pcp_ranks == (0,) and held["node-1"].pcp_ranks == (1,)
    assert held["node-0"].global_ranks == tuple(range(16))
    assert held["node-1"].global_ranks == tuple(range(16, 32))
