"""The n samples of one OpenAI request: n independent Generate calls, their streams merged in arrival order.

Sample i is a Generate call of its own with the request id "<id>-<i>" (just "<id>" when n is 1) and, when
the request has a seed s, the seed s + i: the n samples differ from each other, and the same request with
the same seed gives the same n answers (sample 0 equals the answer to the request sent with n=1).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pcpstack.common.ids import MAX_REQUEST_ID_CHARS
from pcpstack.gateway.openai_requests import ParsedRequest
from pcpstack.gateway.upstream import DecodePool
from pcpstack.v1 import decode_pb2

_END = object()
# Messages per sample that may wait for a slow client.
_MESSAGES_AHEAD = 32


def sample_request_id(request_id: str, sample: int, n: int) -> str:
    """The request id of sample `sample`: the request's own id when n is 1, else "<id>-<sample>" (the id is
    shortened when that would pass the id length limit)."""
    if n == 1:
        return request_id
    suffix = f"-{sample}"
    return request_id[: MAX_REQUEST_ID_CHARS - len(suffix)] + suffix


async def generate_samples(
    pool: DecodePool, parsed: ParsedRequest, request_id: str, timeout: float | None
) -> AsyncIterator[tuple[int, decode_pb2.GenerateResponse]]:
    """(sample index, message) of every sample's stream, in arrival order. The first failure of any sample
    is raised (ApiError) and the other calls are cancelled; closing the iterator cancels them all."""
    requests = [
        parsed.to_generate_request(sample_request_id(request_id, i, parsed.n), i) for i in range(parsed.n)
    ]
    if len(requests) == 1:
        stream = pool.generate(requests[0], timeout)
        try:
            async for message in stream:
                yield 0, message
        finally:
            await stream.aclose()  # at once, not when the collector finds it: the call is cancelled
        return
    # Bounded, so that a slow client slows the calls down (gRPC flow control) instead of filling memory.
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue(maxsize=_MESSAGES_AHEAD * parsed.n)

    async def pump(index: int, request: decode_pb2.GenerateRequest) -> None:
        stream = pool.generate(request, timeout)
        try:
            async for message in stream:
                await queue.put((index, message))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
        else:
            await queue.put((index, _END))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, request)) for i, request in enumerate(requests)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
