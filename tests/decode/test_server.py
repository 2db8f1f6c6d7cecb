"""The Generate servicer over real gRPC, on a pipeline driving the tiny-model stack: requests map to the
pipeline and events to protobuf; errors arrive as their status, also once tokens were streamed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from pcpstack.common.server import ServerOptions, start_server
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.decode.server import SERVICE_NAME, DecodeServicer
from pcpstack.v1 import decode_pb2, decode_pb2_grpc
from tests.decode.support import close_pipeline, greedy, make_pipeline, prompt
from tests.helpers import RunningStack


@contextmanager
def serving(stack: RunningStack, **engine_options) -> Iterator[str]:
    """The address of a Decode server in this process over a fresh pipeline."""
    pipeline, resolver = make_pipeline(stack, **engine_options)
    servicer = DecodeServicer(pipeline)
    running = stack.run(
        start_server(
            lambda server: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server),
            [SERVICE_NAME],
            ServerOptions(host="127.0.0.1", port=0),
        )
    )
    try:
        yield running.address
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
def test_error_after_the_first_token_arrives_as_its_status(stack) -> None:
    # One KV block on this worker: the first token (from prefill) streams, then the batch cannot admit it.
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
    assert "KV blocks" in info.value.details()
    assert [len(m.delta.token_ids) for m in received] == [1]
