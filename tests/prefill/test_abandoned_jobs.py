"""A prefill set with more work queued than its callers wait for, in real processes: registry, a 64 MiB KV
store, a PCP=2 prefill set on the tiny model and a decode worker.

A job whose caller left (its deadline passed, or it hung up) while it still waited in the set's queue
leaves the queue and never runs, so the next caller waits for none of them and the store never takes their
replicas: whether the caller is a direct Prefill client, a decode worker's request (whose Prefill call
carries its deadline) or a client of a decode worker that hangs up without a deadline (the worker cancels
its Prefill call, through the tracing a service's channels carry).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
import torch

from pcpstack.common.errors import DeadlineExceeded
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.decode.pipeline import GenerateInput, TokenPrompt
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.prefill.client import PrefillClient
from pcpstack.v1 import common_pb2
from tests.decode.support import answer, close_pipeline, greedy, make_pipeline
from tests.helpers import RunningStack, pinned_bytes, start_stack

GREEDY = common_pb2.SamplingParams(max_tokens=1, temperature=0)
# Each prompt runs alone in its forward (above batch.BATCH_TOKENS); the tiny model's KV takes 512 bytes a
# token, so a replica is 2 MB and the store holds a burst's.
PROMPT_TOKENS = 4000
REPLICA_BYTES = PROMPT_TOKENS * 512
STORE_BYTES = 64 << 20
BURST = 12

# A caller's attempt: (request id, prompt, timeout) -> whether it was answered (False: its deadline passed).
Attempt = Callable[[str, list[int], float], Awaitable[bool]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(
        tmp_path_factory.mktemp("abandoned-jobs"),
        pcp=2,
        decode=1,
        model="tiny",
        kv_capacity_bytes=STORE_BYTES,
    )
    yield running
    running.stop()


def prompt(seed: int) -> list[int]:
    return torch.randint(0, 256, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()


async def bytes_in(store_address: str) -> int:
    async with KvStoreClient(store_address) as store:
        return (await store.stat()).bytes_in


async def burst(stack: RunningStack, attempt: Attempt, seed: int) -> tuple[int, int, int]:
    """BURST attempts at once whose deadline passes while most of them still queue, then a fresh one with
    time to spare. Returns how many of the burst were answered, the bytes the store took in from the burst's
    start until the fresh one was answered (its replica included), and over the second after that."""
    store = stack.stack.kvstore_address
    assert await attempt(f"warm-{seed}", prompt(seed), 60)
    started = time.monotonic()
    assert await attempt(f"timed-{seed}", prompt(seed + 1), 60)
    # Twice one prefill on an idle set: a couple are answered, the rest still queue at their deadline.
    deadline_s = 2 * (time.monotonic() - started)
    before = await bytes_in(store)
    answered = await asyncio.gather(
        *(attempt(f"left-{seed}-{k}", prompt(seed + 2 + k), deadline_s) for k in range(BURST))
    )
    assert await attempt(f"fresh-{seed}", prompt(seed + 2 + BURST), 60)
    until_fresh = await bytes_in(store)
    await asyncio.sleep(1.0)  # a job left in the queue would run meanwhile
    return sum(answered), until_fresh - before, await bytes_in(store) - until_fresh


def assert_left_jobs_never_ran(answered: int, until_fresh: int, after_fresh: int) -> None:
    assert answered <= BURST // 2, "the burst's deadline left too few jobs queued to tell"
    # The answered ones, one whose answer came back a moment after its deadline, the one in its forward
    # when the deadline passed, and the fresh one: the fresh request was answered after none of the others
    # (it queued behind all BURST of them before).
    assert until_fresh <= (answered + 3) * REPLICA_BYTES
    assert after_fresh == 0


@pytest.mark.slow
def test_prefills_whose_deadline_passed_in_the_queue_never_run_and_the_next_waits_for_none(stack) -> None:
    async def run() -> tuple[int, int, int]:
        client = PrefillClient(next(s.address for s in stack.stack.services if s.name == "prefill-0"))

        async def attempt(request_id: str, ids: list[int], timeout: float) -> bool:
            try:
                reply = await client.prefill(request_id, ids, GREEDY, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                return False
            async with KvStoreClient(reply.kv.store_address) as store:
                await store.release(reply.kv.key, reply.kv.capability)
            return True

        try:
            return await burst(stack, attempt, 0)
        finally:
            await client.close()

    assert_left_jobs_never_ran(*stack.run(run()))


@pytest.mark.slow
def test_generate_requests_whose_deadline_passed_during_prefill_leave_the_sets_queue(stack) -> None:
    pipeline, resolver = make_pipeline(stack)

    async def attempt(request_id: str, ids: list[int], timeout: float) -> bool:
        request = GenerateInput(TokenPrompt(tuple(ids)), greedy(1), request_id=request_id, timeout_s=timeout)
        try:
            await answer(pipeline, request)
        except DeadlineExceeded:
            return False
        return True

    try:
        assert_left_jobs_never_ran(*stack.run(burst(stack, attempt, 100)))
    finally:
        close_pipeline(stack, pipeline, resolver)


@pytest.mark.slow
def test_a_decode_workers_clients_that_hang_up_take_their_queued_prefills_with_them(stack) -> None:
    async def run() -> tuple[int, int, int]:
        client = DecodeClient(stack.decode)

        async def attempt(request_id: str, ids: list[int], wait_s: float) -> bool:
            request = build_request(ids, request_id=request_id, max_tokens=1, ignore_eos=True)
            try:  # the call's own deadline is far off: the client gives up and hangs up after wait_s
                await asyncio.wait_for(client.generate(request, timeout=60), wait_s)
            except TimeoutError:
                return False
            return True

        try:
            return await burst(stack, attempt, 200)
        finally:
            await client.close()

    assert_left_jobs_never_ran(*stack.run(run()))


@pytest.mark.slow
def test_an_answer_its_caller_never_took_in_is_deleted_by_its_abandon_token(stack) -> None:
    """The set answered, but its caller had given up as the answer travelled (the call ended cancelled
    there, successful here): only the set holds the replica's key and capability. Abandon with the token
    the Prefill carried deletes it, and releases no more than that; a token spent, never sent or empty
    deletes nothing, nor does one whose replica's lease is over (the store has reclaimed it), and an
    over-long one is refused with the request."""
    store = stack.stack.kvstore_address
    address = next(s.address for s in stack.stack.services if s.name == "prefill-0")

    async def run() -> tuple[int, bool, bool, bool, bool, int]:
        client = PrefillClient(address)
        try:
            reply = await client.prefill(
                "answer-lost", prompt(300), GREEDY, abandon_token="token-1", timeout=60
            )
            held = await pinned(store)
            assert reply.kv.num_tokens == PROMPT_TOKENS
            # An answer whose lease ends first, kept after one that lives on.
            await client.prefill(
                "lease-over", prompt(302), GREEDY, kv_lease_ms=500, abandon_token="token-2", timeout=60
            )
            await asyncio.sleep(0.8)
            expired = await client.abandon("token-2")
            deleted = await client.abandon("token-1")
            again = await client.abandon("token-1")
            unknown = await client.abandon("never-sent")
            with pytest.raises(grpc.aio.AioRpcError) as empty:
                await client.abandon("")
            assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "abandon_token" in empty.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as long:
                await client.prefill(
                    "token-too-long", prompt(301), GREEDY, abandon_token="x" * 129, timeout=60
                )
            assert long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "abandon_token has 129 characters; at most 128" in long.value.details()
            return held, deleted, again, unknown, expired, await pinned_bytes(store)
        finally:
            await client.close()

    held, deleted, again, unknown, expired, left = stack.run(run())
    assert held >= REPLICA_BYTES  # the answer's replica was pinned for its reader
    assert (deleted, again, unknown, expired, left) == (True, False, False, False, 0)


async def pinned(store_address: str) -> int:
    async with KvStoreClient(store_address) as store:
        return (await store.stat()).pinned_bytes
