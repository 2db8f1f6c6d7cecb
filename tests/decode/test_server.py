"""The Generate servicer over real gRPC, on a pipeline driving the tiny-model stack: requests map to the
pipeline and events to protobuf; errors arrive as their status, also once tokens were streamed; calls the
client cancels at any point leave nothing pinned in the store."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from pcpstack.common.server import ServerOptions, start_server
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.decode.pipeline import GeneratePipeline
from pcpstack.decode.server import SERVICE_NAME, DecodeServicer
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.v1 import decode_pb2, decode_pb2_grpc
from tests.decode.support import close_pipeline, greedy, make_pipeline, prefills_answered, prompt
from tests.helpers import RunningStack, pinned_bytes, prefix_leases


@contextmanager
def serving(stack: RunningStack, **engine_options) -> Iterator[str]:
    """The address of a Decode server in this process over a fresh pipeline."""
    with serving_pipeline(stack, **engine_options) as (address, _):
        yield address


@contextmanager
def serving_pipeline(stack: RunningStack, **options) -> Iterator[tuple[str, GeneratePipeline]]:
    """A Decode server in this process over a fresh pipeline (options: make_pipeline's): its address, and
    the pipeline."""
    pipeline, resolver = make_pipeline(stack, **options)
    servicer = DecodeServicer(pipeline)
    running = stack.run(
        start_server(
            lambda server: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server),
            [SERVICE_NAME],
            ServerOptions(host="127.0.0.1", port=0),
        )
    )
    try:
        yield running.address, pipeline
    finally:
        stack.run(running.stop(0))
        close_pipeline(stack, pipeline, resolver)


async def generate(address: str, request: decode_pb2.GenerateRequest):
    client = DecodeClient(address)
    try:
        return await client.generate(request, timeout=60)
    finally:
        await client.close()


@pytest.mark.slow
def test_stream_carries_the_tokens_and_a_summary(stack, reference) -> None:
    ids = list(prompt(25))
    with serving(stack) as address:
        result = stack.run(
            generate(address, build_request(ids, request_id="srv-1", max_tokens=5, ignore_eos=True))
        )
    assert result.token_ids == reference.generate(ids, greedy(5)).token_ids
    summary = result.summary
    assert summary.finish_reason == decode_pb2.FINISH_REASON_LENGTH
    assert (summary.prompt_tokens, summary.completion_tokens) == (25, 5)
    assert summary.request_id == "srv-1" and list(summary.prompt_token_ids) == ids


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"request_id": "r" * 200}, "request_id is 200 characters; at most 128"),
        ({"top_p": 1.5}, "sampling.top_p=1.5"),
        ({"max_tokens": 0}, "sampling.max_tokens=0"),
    ],
)
def test_bad_request_is_invalid_argument_naming_the_rule(stack, options, needle) -> None:
    with serving(stack) as address, pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(generate(address, build_request(list(prompt(5)), **{"max_tokens": 2, **options})))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


@pytest.mark.slow
def test_a_request_the_cache_can_never_hold_is_refused_before_its_first_token(stack) -> None:
    # One KV block on this worker: the request is refused before prefill, so no token streams (until this
    # check existed, prefill ran and its first token went out before the batch refused the request).
    received: list[decode_pb2.GenerateResponse] = []

    async def stream(address: str) -> None:
        client = DecodeClient(address)
        request = build_request(list(prompt(100)), max_tokens=50, ignore_eos=True)
        try:
            async for message in client.stream(request):
                received.append(message)
        finally:
            await client.close()

    with serving(stack, num_blocks=1) as address, pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(stream(address))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "need 2 KV blocks" in info.value.details()
    assert received == []


@pytest.mark.slow
def test_calls_cancelled_at_every_point_leave_nothing_pinned(stack) -> None:
    # Sixteen calls at once: the even ones cancelled after 1 to 4 messages, the odd ones after a delay
    # (before Prefill is sent, while the set works, as it answers, or while the replica loads); then one
    # call that completes.
    async def cancel_after(address: str, index: int) -> None:
        client = DecodeClient(address)
        request = build_request(list(prompt(200 + 40 * index, index)), max_tokens=60, ignore_eos=True)
        call = client.stream(request)
        try:
            if index % 2:
                await asyncio.sleep(0.02 * index)
            else:
                received = 0
                async for _ in call:
                    received += 1
                    if received > index // 4:
                        break
            call.cancel()
        except grpc.aio.AioRpcError as exc:
            # Sixteen prompts of 200-800 tokens outgrow the 1 MiB store while the others' replicas and cached
            # prefixes are in use: a refusal for room is the answer any client would get.
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
        finally:
            await client.close()

    async def load(address: str, pipeline: GeneratePipeline) -> tuple[bool, int, int]:
        await asyncio.gather(*(cancel_after(address, i) for i in range(16)))
        answered = await prefills_answered(pipeline)
        # The replicas of calls cancelled while their set worked are deleted once their (possibly batched)
        # forward ends, a moment after the answers: until then the 1 MiB store may refuse the follow-up's
        # replica for room (RESOURCE_EXHAUSTED), as it would refuse any client. Retry that a bounded while.
        request = build_request(list(prompt(10)), max_tokens=3, ignore_eos=True)
        for _ in range(40):
            try:
                follow_up = await generate(address, request)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                await asyncio.sleep(0.5)
        else:
            follow_up = await generate(address, request)
        left = (await pinned_bytes(store), await prefix_leases(store))
        return answered, follow_up.summary.completion_tokens, *left

    # A caller that leaves while the set's answer is already on its way (sent, not yet taken by this
    # process's event loop) cannot be told apart from one that left before it: neither end releases that
    # replica, and its lease reclaims it. The pipeline asks for a lease short enough to end within
    # pinned_bytes' wait; every other replica is released or deleted, so at most a few of the sixteen
    # expire (the race needs a cancel within milliseconds of an answer).
    store = stack.stack.kvstore_address
    expired_before = stack.run(_lease_expiries(store))
    with serving_pipeline(stack, kv_lease_ms=LEASE_MS) as (address, pipeline):
        answered, completed, pinned, leases = stack.run(load(address, pipeline))
        assert pipeline.batcher.queue_depth == 0
    assert answered and completed == 3
    assert pinned == 0
    assert leases == 0, f"{leases} prefix leases still held after every call ended"
    expired = stack.run(_lease_expiries(store)) - expired_before
    assert expired <= 3, f"{expired} of 16 cancelled calls left their replica to its lease"


# The replicas' lease in the test of cancelled calls: every call's replica is fetched well within it.
LEASE_MS = 4000


async def _lease_expiries(store_address: str) -> int:
    async with KvStoreClient(store_address) as store:
        return (await store.stat()).lease_expiries
