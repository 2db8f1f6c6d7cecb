"""The prefill service in real processes: registry, KV store and a PCP=2 prefill node on the tiny model.

The replica the set pushes equals single-rank prefill; concurrent requests queue without deadlock; bad
requests are refused before any rank works; a dead rank makes requests fail fast with UNAVAILABLE, takes the
set out of routing, and the set re-forms with a newer generation.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
import torch

from pcpstack.common.channel import open_channel
from pcpstack.engine.engine import Engine
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.prefill.client import PrefillClient
from pcpstack.prefill.replica import replica_owner
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.helpers import child_pids, start_stack

BLOCK_SIZE = 128
GREEDY = common_pb2.SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def reference() -> Engine:
    return Engine.load("tiny", block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(tmp_path_factory.mktemp("prefill-stack"), pcp=2, decode=0, model="tiny")
    yield running
    running.stop()


def prefill_address(stack) -> str:
    return next(s.address for s in stack.stack.services if s.name == "prefill-0")


async def prefill_and_fetch(stack, request_id: str, ids: list[int]):
    client = PrefillClient(prefill_address(stack))
    try:
        reply = await client.prefill(request_id, ids, GREEDY, timeout=60)
    finally:
        await client.close()
    async with KvStoreClient(reply.kv.store_address) as store:
        data, _ = await store.get(reply.kv.key, reply.kv.fingerprint)
        await store.release(reply.kv.key)
    layout = reply.kv.layout
    kv = torch.frombuffer(bytearray(data), dtype=torch.float32)
    return reply, kv.view(layout.num_layers, 2, reply.kv.num_tokens, layout.num_kv_heads, layout.head_dim)


def single_rank(reference: Engine, ids: list[int]) -> tuple[int, torch.Tensor]:
    logits = reference.prefill("ref", ids)
    kv = reference.export_sequence("ref").clone()
    reference.free("ref")
    return int(logits.argmax()), kv


def prompt(n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 5, 300])
def test_pushed_replica_and_first_token_equal_single_rank_prefill(stack, reference, n) -> None:
    request_id = f"replica-{n}"
    reply, kv = stack.run(prefill_and_fetch(stack, request_id, prompt(n)))
    first, expected = single_rank(reference, prompt(n))
    assert reply.first_token_id == first
    assert reply.kv.num_tokens == n and reply.pcp_size == 2
    assert reply.kv.source_pcp_rank == replica_owner(request_id, 2)
    assert reply.kv.fingerprint == reference.layout.fingerprint()
    assert (kv - expected).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_concurrent_prefills_queue_and_all_complete(stack, reference) -> None:
    async def burst():
        return await asyncio.gather(
            *(prefill_and_fetch(stack, f"burst-{i}", prompt(20 + i)) for i in range(6))
        )

    for i, (reply, kv) in enumerate(stack.run(burst())):
        first, expected = single_rank(reference, prompt(20 + i))
        assert reply.first_token_id == first
        assert (kv - expected).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ids", "code", "needle"),
    [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        ([1] * 100_000, grpc.StatusCode.INVALID_ARGUMENT, "exceed the model context"),
        ([1, 2, 10**6], grpc.StatusCode.INVALID_ARGUMENT, "token_ids[2]"),
    ],
)
def test_bad_prompts_are_refused_before_any_rank_works(stack, ids, code, needle) -> None:
    async def call():
        client = PrefillClient(prefill_address(stack))
        try:
            await client.prefill("bad", ids, GREEDY, timeout=10)
        finally:
            await client.close()

    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(call())
    assert info.value.code() == code
    assert needle in info.value.details()


@pytest.mark.slow
def test_wrong_expected_fingerprint_is_failed_precondition(stack) -> None:
    async def call():
        client = PrefillClient(prefill_address(stack))
        try:
            await client.prefill("fp", [1, 2], GREEDY, expected_fingerprint="0" * 64, timeout=10)
        finally:
            await client.close()

    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(call())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def _sets(stack) -> list[registry_pb2.PcpSet]:
    async with open_channel(stack.stack.registry_address, default_deadline=5) as channel:
        return list(
            (
                await registry_pb2_grpc.RegistryServiceStub(channel).ListSets(registry_pb2.ListSetsRequest())
            ).sets
        )


@pytest.mark.slow
def test_dead_rank_fails_requests_fast_and_the_set_reforms(stack) -> None:
    """Runs last in this module: it breaks the set (which then heals)."""
    before = stack.run(_sets(stack))
    assert [s.state for s in before] == [registry_pb2.SET_STATE_READY]
    node = next(s for s in stack.stack.services if s.name == "prefill-0")
    ranks = child_pids(node.process.pid)
    assert len(ranks) >= 2
    os.kill(ranks[-1], signal.SIGKILL)  # the last started: PCP rank 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(prefill_and_fetch(stack, "after-death", prompt(10)))
    # refused, not left to run into the call's deadline (that would be DEADLINE_EXCEEDED)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sets = stack.run(_sets(stack))
        if (
            sets
            and sets[0].state == registry_pb2.SET_STATE_READY
            and sets[0].generation > before[0].generation
        ):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the set did not re-form: {sets}")
    reply, _ = stack.run(prefill_and_fetch(stack, "healed", prompt(10)))
    assert reply.generation == sets[0].generation
