"""One request must not hurt the others: through decode, on a stack of one PCP=2 set (tiny model).

A request id sent twice in a row is served twice (KV keys are per attempt); a positive temperature too
small to divide by is served greedily; a request whose replica the store refuses fails alone with the
store's status. After each, the set is still the same generation, still routed, and serves the next
request.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.v1 import registry_pb2
from tests.helpers import RunningStack
from tests.reliability.support import list_sets, start_tuned_stack

pytestmark = pytest.mark.slow

PROMPT = [(5 * i + 1) % 256 for i in range(40)]
# The tiny model's KV takes 512 bytes a token: a 4000-token replica does not fit in 1 MiB.
KV_CAPACITY_BYTES = 1 << 20
OVERFLOW = [(3 * i + 2) % 256 for i in range(4000)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    running = start_tuned_stack(
        tmp_path_factory.mktemp("isolation"), pcp=2, decode=1, kv_capacity_bytes=KV_CAPACITY_BYTES
    )
    yield running
    running.stop()


async def _generate(address: str, prompt: list[int], **options) -> list[int]:
    client = DecodeClient(address)
    try:
        return (await client.generate(build_request(prompt, max_tokens=4, **options), timeout=60)).token_ids
    finally:
        await client.close()


def generate(stack: RunningStack, prompt: list[int] = PROMPT, **options) -> list[int]:
    return stack.run(_generate(stack.decode, prompt, **options))


def the_ready_set(stack: RunningStack) -> registry_pb2.PcpSet:
    (only,) = list_sets(stack)
    assert only.state == registry_pb2.SET_STATE_READY
    return only


def test_same_request_id_twice_in_a_row_is_served_twice_by_the_same_set(stack) -> None:
    before = the_ready_set(stack)
    first = generate(stack, request_id="client-reused-id")
    assert generate(stack, request_id="client-reused-id") == first
    assert the_ready_set(stack).generation == before.generation


def test_a_positive_temperature_too_small_to_divide_by_is_served_greedily(stack) -> None:
    before = the_ready_set(stack)
    assert generate(stack, temperature=1e-45) == generate(stack)
    assert the_ready_set(stack).generation == before.generation


def test_a_replica_the_store_refuses_fails_that_request_alone(stack) -> None:
    before = the_ready_set(stack)
    expected = generate(stack)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        generate(stack, OVERFLOW)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert generate(stack) == expected
    assert the_ready_set(stack).generation == before.generation
