"""The registry killed (SIGKILL) for an outage, then restarted on its address with its command line.

While it is away, streams in progress finish and new requests are routed from the decode worker's cached
Resolve answer (the outage is PCPSTACK_REGISTRY_OUTAGE_S, 30 s by default: fifteen leases and thirty resolver
TTLs, so no cached answer is fresh and no lease-based expiry is pending). When it returns, every node
re-registers carrying what it runs: the same sets come back (same set_id, generation and members) without a
re-launch of any rank, and requests keep succeeding, also in the seconds after the restart before the nodes
are back (the restarted registry says it is warming up, so its empty answer does not replace the cache).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest

from pcpstack.common.channel import open_channel
from pcpstack.v1 import registry_pb2, registry_pb2_grpc
from tests.helpers import RunningStack
from tests.reliability.support import (
    generate,
    in_thread,
    kill_service,
    list_nodes,
    list_sets,
    rank_pids,
    restart_service,
    service,
    start_tuned_stack,
    wait_store_unpinned,
    wait_until,
)

pytestmark = pytest.mark.slow

OUTAGE_S = float(os.environ.get("PCPSTACK_REGISTRY_OUTAGE_S", "30"))
MIN_SERVED = 5  # requests answered during the outage, however long each takes
PROMPTS = [[(13 * i + k) % 256 for i in range(30 + 7 * k)] for k in range(4)]
NODES = {"kvstore-0", "prefill-0", "prefill-1", "decode-0"}


@pytest.fixture
def stack(tmp_path) -> Iterator[RunningStack]:
    running = start_tuned_stack(tmp_path, pcp=2, prefill_sets=2)
    yield running
    running.stop()


def registry_answers(stack: RunningStack) -> bool:
    """True once the registry answers Resolve (whatever it knows)."""

    async def ask() -> None:
        async with open_channel(stack.stack.registry_address, default_deadline=1) as channel:
            await registry_pb2_grpc.RegistryServiceStub(channel).Resolve(registry_pb2.ResolveRequest())

    try:
        stack.run(asyncio.wait_for(ask(), 5))
    except Exception:
        return False
    return True


def picture(sets: list[registry_pb2.PcpSet]) -> list[tuple]:
    return [(s.set_id, s.generation, tuple(s.member_node_ids), s.state) for s in sets]


def test_registry_outage_keeps_serving_and_the_same_sets_come_back(stack) -> None:
    expected = [stack.run(generate(stack.decode, p)).token_ids for p in PROMPTS]
    sets_before = picture(list_sets(stack))
    assert [s[3] for s in sets_before] == [registry_pb2.SET_STATE_READY] * 2
    ranks_before = {n: rank_pids(service(stack, n)) for n in ("prefill-0", "prefill-1")}
    streams = [in_thread(generate(stack.decode, p, max_tokens=1000, timeout=120)) for p in PROMPTS[:2]]
    time.sleep(0.5)
    victim = kill_service(stack, "registry")
    down_at = time.monotonic()

    served = 0
    while served < MIN_SERVED or time.monotonic() - down_at < OUTAGE_S:
        prompt = served % len(PROMPTS)
        assert stack.run(generate(stack.decode, PROMPTS[prompt])).token_ids == expected[prompt]
        served += 1
        time.sleep(1.0)
    assert all(len(s.result(timeout=120).token_ids) == 1000 for s in streams)
    assert list_sets(stack) == []  # the registry really was away

    restart_service(stack, victim)
    wait_until("the restarted registry to answer", lambda: registry_answers(stack), timeout=30)
    # at once, before the nodes are back: still routed from the cached endpoints, no "no ready set"
    assert [stack.run(generate(stack.decode, p)).token_ids for p in PROMPTS] == expected
    wait_until(
        "every node to re-register alive",
        lambda: {n.node_id for n in list_nodes(stack) if n.state != registry_pb2.NODE_STATE_DEAD} == NODES,
        timeout=30,
    )
    wait_until("the same sets to come back", lambda: picture(list_sets(stack)) == sets_before, timeout=30)
    assert {n: rank_pids(service(stack, n)) for n in ranks_before} == ranks_before
    assert [stack.run(generate(stack.decode, p)).token_ids for p in PROMPTS] == expected
    wait_store_unpinned(stack)
