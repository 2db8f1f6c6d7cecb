"""Decode workers that hold their --max-requests already, in real processes (registry, KV store, a PCP=2
set on the tiny model, two decode workers each holding at most one request): a worker refuses one more at
once with RESOURCE_EXHAUSTED saying it is busy; the gateway's pool sends such a request to another worker,
and when every worker is busy the gateway answers 429 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from contextlib import asynccontextmanager

import grpc
import pytest

from pcpstack.decode.client import BUSY, DecodeClient, build_request
from pcpstack.gateway.errors import ApiError
from pcpstack.gateway.upstream import DecodePool
from tests.helpers import start_stack

pytestmark = pytest.mark.timeout(300)
PROMPT = list(range(16))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(
        tmp_path_factory.mktemp("busy-workers"),
        pcp=2,
        decode=2,
        model="tiny",
        decode_max_requests=1,
        gateway=True,
    )
    yield running
    running.stop()


@asynccontextmanager
async def holding(address: str):
    """A request the worker at address holds until the block ends: its first token is read, the rest left
    unread (the worker's stream waits on flow control before 4,000 tokens are all sent)."""
    client = DecodeClient(address)
    call = client.stream(build_request(PROMPT, max_tokens=4000, ignore_eos=True))
    try:
        await anext(aiter(call))
        yield
    finally:
        call.cancel()
        await client.close()


def post(gateway_url: str) -> tuple[int, str | None, dict]:
    """An HTTP completion through the gateway: its status, Retry-After header and body."""
    request = urllib.request.Request(
        f"{gateway_url}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.headers.get("Retry-After"), json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Retry-After"), json.loads(error.read())


async def answer(pool: DecodePool) -> int:
    """Tokens of one request through the pool."""
    tokens = 0
    async for message in pool.generate(build_request(PROMPT, max_tokens=4), timeout=60):
        tokens += len(message.delta.token_ids)
    return tokens


def test_a_busy_worker_refuses_at_once_and_the_pool_tries_the_other_then_answers_429(stack) -> None:
    first, second = stack.stack.decode_addresses

    async def run() -> tuple[grpc.StatusCode, str, int, int]:
        pool = DecodePool([first, second])  # the first is chosen first: both idle, neither used yet
        try:
            async with holding(first):
                client = DecodeClient(first)
                try:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for _ in client.stream(build_request(PROMPT, max_tokens=4), timeout=10):
                            pass
                finally:
                    await client.close()
                elsewhere = await answer(pool)  # refused by the first, answered by the second
                async with holding(second):
                    with pytest.raises(ApiError) as everywhere:
                        await answer(pool)
                    http = await asyncio.to_thread(post, stack.stack.gateway_url)
            after = await answer(pool)  # room again once the held requests ended
            assert everywhere.value.status == 429 and BUSY in str(everywhere.value)
            status, retry_after, body = http
            assert (status, retry_after, body["error"]["type"]) == (429, "1", "resource_exhausted")
            return refused.value.code(), refused.value.details(), elsewhere, after
        finally:
            await pool.close()

    code, details, elsewhere, after = stack.run(run())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith(BUSY) and "--max-requests" in details
    assert (elsewhere, after) == (4, 4)
