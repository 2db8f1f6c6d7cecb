"""The prefill service in real processes: registry, KV store and a PCP=2 prefill node on the tiny model.

The replica the set pushes equals single-rank prefill, also when the set runs a prompt in chunks; concurrent
requests queue without deadlock; bad requests, a prompt above the set's KV capacity and a kv_lease_ms above
the store's cap are refused before any rank works (a node whose own --kv-lease-ms is, at start-up); a
prompt extending a stored one computes only its new tokens and its KV (cached prefix plus
new object) equals single-rank prefill; one request's failure (a refused push) fails that request alone
and the set serves the next; a dead rank makes requests fail fast with UNAVAILABLE, takes the set out of
routing, and the set re-forms with a newer generation.
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
from pcpstack.kvstore.prefix import segment_range
from pcpstack.kvstore.store import DEFAULT_MAX_LEASE_MS
from pcpstack.prefill.client import PrefillClient
from pcpstack.prefill.replica import replica_owner
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.common.test_startup import REGISTRY, refusal
from tests.helpers import child_pids, start_stack

BLOCK_SIZE = 128
GREEDY = common_pb2.SamplingParams(max_tokens=1, temperature=0)
# The tiny model's KV takes 512 bytes a token: the store holds the tests' prompts (at most a few hundred
# tokens) but refuses a replica of STORE_OVERFLOW tokens, which the ranks' caches still hold.
KV_CAPACITY_BYTES = 1 << 20
STORE_OVERFLOW = 3000
# Each rank's cache (--kv-cache-tokens), below the tiny model's 4,096-token context so a prompt can exceed it.
RANK_KV_TOKENS = 3072
# Prompts longer than this run in chunks (--prefill-chunk-tokens).
CHUNK_TOKENS = 128


@pytest.fixture(scope="module")
def reference() -> Engine:
    return Engine.load("tiny", block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(
        tmp_path_factory.mktemp("prefill-stack"),
        pcp=2,
        decode=0,
        model="tiny",
        kv_capacity_bytes=KV_CAPACITY_BYTES,
        prefill_kv_cache_tokens=RANK_KV_TOKENS,
        prefill_chunk_tokens=CHUNK_TOKENS,
    )
    yield running
    running.stop()


def prefill_address(stack) -> str:
    return next(s.address for s in stack.stack.services if s.name == "prefill-0")


async def prefill_and_fetch(
    stack, request_id: str, ids: list[int], sampling: common_pb2.SamplingParams = GREEDY, **options
):
    client = PrefillClient(prefill_address(stack))
    try:
        reply = await client.prefill(request_id, ids, sampling, timeout=60, **options)
    finally:
        await client.close()
    async with KvStoreClient(reply.kv.store_address) as store:
        data, _ = await store.get(reply.kv.key, reply.kv.fingerprint, reply.kv.capability)
        await store.release(reply.kv.key, reply.kv.capability)
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
# 299 runs in three chunks (128, 128, 43), none a multiple of 2P.
@pytest.mark.parametrize("n", [1, 5, 299])
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
def test_a_prompt_above_the_kv_capacity_is_refused_naming_both_numbers_and_the_set_serves_the_next(
    stack, reference
) -> None:
    generation = stack.run(_sets(stack))[0].generation
    error = prefill_error(stack, "too-long", prompt(RANK_KV_TOKENS + 1))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert f"{RANK_KV_TOKENS + 1} tokens" in error.details()
    assert f"capacity of {RANK_KV_TOKENS} tokens" in error.details()
    reply, _ = stack.run(prefill_and_fetch(stack, "after-too-long", prompt(11)))
    assert reply.first_token_id == single_rank(reference, prompt(11))[0]
    assert reply.generation == generation


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


def prefill_error(stack, request_id: str, ids: list[int], **options) -> grpc.aio.AioRpcError:
    """The error a prefill that must fail answers with."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(prefill_and_fetch(stack, request_id, ids, **options))
    return info.value


@pytest.mark.slow
def test_positive_temperature_too_small_to_divide_by_is_served_greedily_and_the_set_stays(
    stack, reference
) -> None:
    generation = stack.run(_sets(stack))[0].generation
    tiny = common_pb2.SamplingParams(max_tokens=1, temperature=1e-45)
    reply, _ = stack.run(prefill_and_fetch(stack, "tiny-temperature", prompt(12), tiny))
    assert reply.first_token_id == single_rank(reference, prompt(12))[0]
    assert reply.generation == generation
    assert stack.run(prefill_and_fetch(stack, "after-tiny", prompt(9)))[0].generation == generation


@pytest.mark.slow
def test_same_request_id_twice_in_a_row_both_succeed_under_distinct_keys(stack) -> None:
    first, _ = stack.run(prefill_and_fetch(stack, "reused-id", prompt(7)))
    second, _ = stack.run(prefill_and_fetch(stack, "reused-id", prompt(7)))
    assert first.kv.key != second.kv.key
    assert first.kv.key.startswith("reused-id") and second.kv.key.startswith("reused-id")
    assert first.first_token_id == second.first_token_id


@pytest.mark.slow
@pytest.mark.parametrize(("request_id", "needle"), [("x" * 600, "at most 128"), ("bad\nid", "'\\n'")])
def test_a_request_id_that_cannot_name_a_replica_is_refused_before_any_rank_works(
    stack, request_id, needle
) -> None:
    error = prefill_error(stack, request_id, prompt(3))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in error.details() and needle in error.details()


@pytest.mark.slow
def test_a_kvstore_address_the_registry_does_not_list_is_refused_naming_it(stack) -> None:
    error = prefill_error(stack, "elsewhere", prompt(5), kvstore_address="127.0.0.1:1")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "127.0.0.1:1" in error.details()
    listed, _ = stack.run(
        prefill_and_fetch(stack, "listed-store", prompt(5), kvstore_address=stack.stack.kvstore_address)
    )
    assert listed.kv.store_address == stack.stack.kvstore_address


async def _store_stat(address: str):
    async with KvStoreClient(address) as store:
        return await store.stat()


@pytest.mark.slow
def test_a_kv_lease_over_the_stores_cap_is_refused_naming_kv_lease_ms_before_any_rank_works(stack) -> None:
    store = stack.stack.kvstore_address
    before = stack.run(_store_stat(store))
    error = prefill_error(stack, "lease-over-cap", prompt(6), kv_lease_ms=DEFAULT_MAX_LEASE_MS + 1)
    after = stack.run(_store_stat(store))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(
        f"kv_lease_ms={DEFAULT_MAX_LEASE_MS + 1} is refused by KV store {store}"
    )
    assert f"cap of {DEFAULT_MAX_LEASE_MS} ms" in error.details()
    assert (after.bytes_in, after.refused_puts) == (before.bytes_in, before.refused_puts)
    at_cap, _ = stack.run(
        prefill_and_fetch(stack, "lease-at-cap", prompt(6), kv_lease_ms=DEFAULT_MAX_LEASE_MS)
    )
    assert at_cap.kv.num_tokens == 6


@pytest.mark.slow
def test_a_node_whose_kv_lease_its_store_refuses_is_refused_at_start_up(stack, child_env) -> None:
    store, lease = stack.stack.kvstore_address, DEFAULT_MAX_LEASE_MS + 1
    args = ["--kvstore", store, "--kv-lease-ms", str(lease), "--model", "tiny", "--port", "0"]
    line = refusal(child_env, "prefill", "--registry", REGISTRY, "--log-level", "WARNING", *args)
    assert f"--kv-lease-ms={lease} is refused by --kvstore {store}" in line
    assert f"cap of {DEFAULT_MAX_LEASE_MS} ms" in line


@pytest.mark.slow
def test_a_refused_push_fails_that_request_alone_and_leaves_no_pending_task(stack) -> None:
    generation = stack.run(_sets(stack))[0].generation
    overflow = torch.randint(0, 256, (STORE_OVERFLOW,), generator=torch.Generator().manual_seed(1)).tolist()
    for attempt in range(2):
        error = prefill_error(stack, f"overflow-{attempt}", overflow)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "could not push its KV replica" in error.details()
    reply, _ = stack.run(prefill_and_fetch(stack, "after-overflow", prompt(10)))
    assert reply.generation == generation
    log = next(s for s in stack.stack.services if s.name == "prefill-0").log_path.read_text()
    assert "Task was destroyed but it is pending" not in log
    assert "asynchronous generator is already running" not in log


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


@pytest.mark.slow
def test_a_prompt_extending_a_stored_one_computes_only_its_new_tokens_and_its_kv_stays_exact(
    stack, reference
) -> None:
    ids = torch.randint(0, 256, (340,), generator=torch.Generator().manual_seed(18))[:300].tolist()
    longer = torch.randint(0, 256, (340,), generator=torch.Generator().manual_seed(18)).tolist()

    async def turns():
        client = PrefillClient(prefill_address(stack))
        try:
            # Offers its 17 full prefix blocks of 16 tokens (272 tokens; the paged blocks are 128).
            first = await client.prefill("turn-1", ids[:280], GREEDY, timeout=60)
            second = await client.prefill("turn-2", ids, GREEDY, timeout=60)
            salted = await client.prefill("turn-2-salted", ids, GREEDY, cache_salt="other", timeout=60)
            # Its prefix is in two objects: turn 1's 17 blocks and the one full block turn 2 added.
            third = await client.prefill("turn-3", longer, GREEDY, timeout=60)
        finally:
            await client.close()
        async with KvStoreClient(second.kv.store_address) as store:
            for reply in (first, salted, third):
                await store.release(reply.kv.key, reply.kv.capability)
            assert await store.release(third.kv.prefix_lease_id, third.kv.prefix_lease_capability, lease=True)
            kv = second.kv
            # Decode's read of a handle with a cached prefix: the prefix segments through the lease, then the
            # object holding the rest.
            rows = kv.layout.num_kv_heads * kv.layout.head_dim * 4
            parts = []
            for segment in kv.prefix_segments:
                selection = segment_range(
                    segment.object_bytes,
                    kv.layout.num_layers * 2,
                    rows,
                    segment.token_start,
                    segment.token_count,
                )
                data, _ = await store.get(
                    segment.key,
                    kv.fingerprint,
                    kv.prefix_lease_capability,
                    ranges=[selection],
                    lease_id=kv.prefix_lease_id,
                )
                parts.append((segment.token_count, data))
            data, _ = await store.get(kv.key, kv.fingerprint, kv.capability)
            parts.append((kv.num_tokens - kv.cached_tokens, data))
            await store.release(kv.key, kv.capability)
            assert await store.release(kv.prefix_lease_id, kv.prefix_lease_capability, lease=True)
        layout = kv.layout
        whole = torch.cat(
            [
                torch.frombuffer(bytearray(data), dtype=torch.float32).view(
                    layout.num_layers, 2, tokens, layout.num_kv_heads, layout.head_dim
                )
                for tokens, data in parts
            ],
            dim=2,
        )
        return second, salted, third, whole

    second, salted, third, whole = stack.run(turns())
    assert (third.kv.cached_tokens, len(third.kv.prefix_segments)) == (288, 2)
    assert third.first_token_id == single_rank(reference, longer)[0]
    first_token, expected = single_rank(reference, ids)
    assert (second.kv.cached_tokens, second.computed_tokens) == (272, 28)
    assert (salted.kv.cached_tokens, salted.computed_tokens) == (0, 300)  # another salt shares no block
    assert second.first_token_id == salted.first_token_id == first_token
    assert (whole - expected).abs().max().item() <= 1e-4
