"""A headless PCP rank killed (SIGKILL) while a prefill is in flight, on a stack of two PCP=2 sets.

A prefill on the tiny model takes milliseconds, so the test holds a request inside the set for real: the
headless ranks are frozen (SIGSTOP) before the request is sent; the master rank takes the job and blocks in
the first all-gather of the prefill; the registry's load report shows which set holds it; only then is that
set's headless rank killed. The request must fail over to the other ready set and answer correctly, or fail
with UNAVAILABLE before its deadline when no other set is ready; the broken set leaves routing and re-forms
with a newer generation once its node's ranks are back. The same holds for a TP rank of a TP=2 set: its
death fails the request in flight with UNAVAILABLE before its deadline, and the set re-forms.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import Future

import grpc
import pytest

from pcpstack.kvstore.client import KvStoreClient
from pcpstack.prefill.client import PrefillClient
from pcpstack.v1 import common_pb2, registry_pb2
from tests.helpers import RunningStack
from tests.reliability.support import (
    generate,
    in_thread,
    list_sets,
    rank_pids,
    service,
    signal_all,
    start_tuned_stack,
    wait_prefill_idle,
    wait_prefill_in_flight,
    wait_store_unpinned,
    wait_until,
)

pytestmark = pytest.mark.slow

PROMPT = [(7 * i + 3) % 256 for i in range(300)]
DEADLINE_S = 30.0


@pytest.fixture
def tp_stack(tmp_path) -> Iterator[RunningStack]:
    """One TP=2 set (two rank processes on one node) and no decode worker: Prefill is called directly."""
    running = start_tuned_stack(tmp_path, tp=2, pcp=1, decode=0)
    yield running
    running.stop()


async def prefill(address: str, request_id: str, timeout: float) -> int:
    """The first token of a greedy Prefill of PROMPT; its replica's shards are deleted at once."""
    client = PrefillClient(address)
    try:
        reply = await client.prefill(
            request_id, PROMPT, common_pb2.SamplingParams(max_tokens=1, temperature=0), timeout=timeout
        )
    finally:
        await client.close()
    async with KvStoreClient(reply.kv.store_address) as store:
        for shard in reply.kv.shards:
            await store.delete(shard.key, shard.capability)
    return reply.first_token_id


# First in the module: its stack starts and stops before the module's two-set stack exists.
def test_killed_tp_rank_fails_the_request_unavailable_and_its_set_reforms(tp_stack) -> None:
    stack = tp_stack
    node = service(stack, "prefill-0")
    expected = stack.run(prefill(node.address, "tp-before", DEADLINE_S))
    (before,) = ready_sets(stack).values()
    _, tp_rank_1 = rank_pids(node)
    wait_prefill_idle(stack)
    signal_all([tp_rank_1], signal.SIGSTOP)
    answer = in_thread(prefill(node.address, "tp-killed", DEADLINE_S))
    wait_prefill_in_flight(stack)  # rank 0 holds the job, waiting in the first TP all-reduce
    signal_all([tp_rank_1], signal.SIGKILL)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        answer.result(timeout=DEADLINE_S + 15)
    # UNAVAILABLE, not DEADLINE_EXCEEDED: it failed before its deadline
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    wait_until("the TP set to leave routing", lambda: not ready_sets(stack), timeout=30)
    reformed = wait_until(
        "the TP set to re-form with a newer generation",
        lambda: (s := list(ready_sets(stack).values())) and s[0].generation > before.generation and s[0],
        timeout=60,
    )
    assert reformed.dp_rank == before.dp_rank
    assert stack.run(prefill(node.address, "tp-after", DEADLINE_S)) == expected
    wait_store_unpinned(stack)


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


def hold_in_one_set(stack: RunningStack, ranks: dict[str, int]) -> tuple[Future, str, str]:
    """Freezes both sets' headless ranks, sends a request and waits until one set holds it, then lets the
    other set's rank run again: the answer's future, the node of the set holding it, the other node."""
    wait_prefill_idle(stack)
    signal_all(list(ranks.values()), signal.SIGSTOP)
    answer = in_thread(generate(stack.decode, PROMPT, timeout=DEADLINE_S))
    victim = wait_prefill_in_flight(stack)
    survivor = next(node for node in ranks if node != victim)
    signal_all([ranks[survivor]], signal.SIGCONT)
    return answer, victim, survivor


def wait_reformed(stack: RunningStack, node: str, before: dict[str, registry_pb2.PcpSet]) -> None:
    """Waits until the set of node is ready again with a newer generation, in the same slot."""
    reformed = wait_until(
        f"the set of {node} to re-form with a newer generation",
        lambda: (s := ready_sets(stack).get(node)) and s.generation > before[node].generation and s,
        timeout=60,
    )
    assert reformed.dp_rank == before[node].dp_rank


def test_killed_headless_rank_fails_over_and_its_set_reforms(stack) -> None:
    expected = stack.run(generate(stack.decode, PROMPT)).token_ids
    before = ready_sets(stack)
    assert len(before) == 2
    ranks = headless_ranks(stack)
    answer, victim, survivor = hold_in_one_set(stack, ranks)
    signal_all([ranks[victim]], signal.SIGKILL)

    assert answer.result(timeout=DEADLINE_S + 15).token_ids == expected
    # The lease bound itself is checked on a controlled clock (tests/registry/test_membership.py); here the
    # wait only guards against a set that never leaves routing.
    wait_until(
        f"the set of {victim} to leave routing", lambda: ready_sets(stack).get(victim) is None, timeout=30
    )
    wait_reformed(stack, victim, before)
    assert ready_sets(stack)[survivor].generation == before[survivor].generation
    assert stack.run(generate(stack.decode, PROMPT)).token_ids == expected
    wait_store_unpinned(stack)


def test_a_frozen_headless_rank_is_noticed_mid_job_and_the_request_fails_over(stack) -> None:
    """The headless rank stopped (SIGSTOP) and left so, the way a frozen process is: the set in flight is
    failed by its node's watchdog within its stale bound (10 s), not by the collective timeout (120 s), the
    request answers from the other set, and the node replaces the frozen rank (it is killed)."""
    wait_until("both sets to be ready", lambda: len(ready_sets(stack)) == 2, timeout=60)
    before = ready_sets(stack)
    expected = stack.run(generate(stack.decode, PROMPT)).token_ids
    ranks = headless_ranks(stack)
    answer, victim, _ = hold_in_one_set(stack, ranks)

    assert answer.result(timeout=DEADLINE_S + 15).token_ids == expected
    wait_reformed(stack, victim, before)
    assert ranks[victim] not in rank_pids(service(stack, victim))  # the frozen one was replaced
    assert "has not run for" in (stack.stack.log_dir / f"{victim}.log").read_text(errors="replace")
    assert stack.run(generate(stack.decode, PROMPT)).token_ids == expected
    wait_store_unpinned(stack)


def test_with_no_other_ready_set_the_request_fails_unavailable_before_its_deadline(stack) -> None:
    wait_until("both sets to be ready", lambda: len(ready_sets(stack)) == 2, timeout=60)
    ranks = list(headless_ranks(stack).values())
    wait_prefill_idle(stack)
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
