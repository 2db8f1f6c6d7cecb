"""A headless PCP rank killed (SIGKILL) while a prefill is in flight, on a stack of two PCP=2 sets.

A prefill on the tiny model takes milliseconds, so the test holds a request inside the set for real: the
headless ranks are frozen (SIGSTOP) before the request is sent; the master rank takes the job and blocks in
the first all-gather of the prefill; the registry's load report shows which set holds it; only then is that
set's headless rank killed. The request must fail over to the other ready set and answer correctly, or fail
with UNAVAILABLE before its deadline when no other set is ready; the broken set leaves routing and re-forms
with a newer generation once its node's ranks are back.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import grpc
import pytest

from pcpstack.v1 import registry_pb2
from tests.helpers import RunningStack
from tests.reliability.support import (
    generate,
    in_thread,
    list_sets,
    rank_pids,
    service,
    signal_all,
    start_tuned_stack,
    wait_prefill_in_flight,
    wait_store_unpinned,
    wait_until,
)

pytestmark = pytest.mark.slow

PROMPT = [(7 * i + 3) % 256 for i in range(300)]
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    running = start_tuned_stack(tmp_path_factory.mktemp("rank-kill"), pcp=2, prefill_sets=2)
    yield running
    running.stop()


def headless_ranks(stack: RunningStack) -> dict[str, int]:
    """node_id -> pid of its PCP rank 1 (the headless rank of its single-node set)."""
    ranks = {}
    for index in range(2):
        pids = rank_pids(service(stack, f"prefill-{index}"))
        assert len(pids) == 2, f"prefill-{index} runs ranks {pids}"
        ranks[f"prefill-{index}"] = pids[1]
    return ranks


def ready_sets(stack: RunningStack) -> dict[str, registry_pb2.PcpSet]:
    """node_id of the master -> its set, for the sets the registry routes to."""
    return {s.member_node_ids[0]: s for s in list_sets(stack) if s.state == registry_pb2.SET_STATE_READY}


def test_killed_headless_rank_fails_over_and_its_set_reforms(stack) -> None:
    expected = stack.run(generate(stack.decode, PROMPT)).token_ids
    before = ready_sets(stack)
    assert len(before) == 2
    ranks = headless_ranks(stack)
    signal_all(list(ranks.values()), signal.SIGSTOP)
    answer = in_thread(generate(stack.decode, PROMPT, timeout=DEADLINE_S))
    victim = wait_prefill_in_flight(stack)
    survivor = next(node for node in ranks if node != victim)
    signal_all([ranks[survivor]], signal.SIGCONT)
    signal_all([ranks[victim]], signal.SIGKILL)

    assert answer.result(timeout=DEADLINE_S + 15).token_ids == expected
    # The lease bound itself is checked on a controlled clock (tests/registry/test_membership.py); here the
    # wait only guards against a set that never leaves routing.
    wait_until(
        f"the set of {victim} to leave routing", lambda: ready_sets(stack).get(victim) is None, timeout=30
    )
    reformed = wait_until(
        f"the set of {victim} to re-form with a newer generation",
        lambda: (s := ready_sets(stack).get(victim)) and s.generation > before[victim].generation and s,
        timeout=60,
    )
    assert reformed.dp_rank == before[victim].dp_rank
    assert ready_sets(stack)[survivor].generation == before[survivor].generation
    assert stack.run(generate(stack.decode, PROMPT)).token_ids == expected
    wait_store_unpinned(stack)


def test_with_no_other_ready_set_the_request_fails_unavailable_before_its_deadline(stack) -> None:
    wait_until("both sets to be ready", lambda: len(ready_sets(stack)) == 2, timeout=60)
    ranks = list(headless_ranks(stack).values())
    signal_all(ranks, signal.SIGSTOP)
    answer = in_thread(generate(stack.decode, PROMPT, timeout=DEADLINE_S))
    wait_prefill_in_flight(stack)
    signal_all(ranks, signal.SIGKILL)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        answer.result(timeout=DEADLINE_S + 15)
    # UNAVAILABLE, not DEADLINE_EXCEEDED: it failed before its deadline
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    wait_until("both sets to re-form", lambda: len(ready_sets(stack)) == 2, timeout=60)
    assert len(stack.run(generate(stack.decode, PROMPT)).token_ids) == 8
    wait_store_unpinned(stack)
