"""A decode worker with decode context parallelism behind real peers: `pcpstack serve decode` with
tensor_parallel_size=4 and decode_context_parallel_size=2 on the tiny model (2 K/V heads: ranks 0-1 hold head
0, ranks 2-3 head 1, and each pair splits every sequence's tokens by block) joins the session's tiny-model
stack. Each rank loads only its own blocks with ranged Gets; the greedy answer equals the plain engine's. When
a prompt's leading blocks are cached (another request's), each rank reads its blocks of them and of the new
tokens alike. When one DCP rank is killed mid-stream, the stream ends UNAVAILABLE, the worker leaves routing
and exits 1, nothing stays pinned in the store, and a worker started again serves.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import grpc
import pytest

from pcpstack.decode.client import DecodeClient, build_request
from tests.decode.support import BLOCK_SIZE, greedy, prompt
from tests.decode.test_tp_worker import follower_ranks, greedy_answer, running_tp_worker
from tests.helpers import RunningStack, pinned_bytes
from tests.reliability.support import list_nodes

TP, DCP = 4, 2
# A dead rank is seen at once (its connections close); the timeout only bounds a hang, and is far enough
# above a step's time on two busy cores that a slow step never trips it.
DCP_FLAGS = ("--set", f"decode_context_parallel_size={DCP}", "--collective-timeout", "30")
# Three blocks and a part: rank 0 of each pair holds blocks 0 and 2, rank 1 block 1 and the short block 3.
PROMPT_TOKENS = 3 * BLOCK_SIZE + 45


@pytest.fixture(scope="module")
def dcp_worker(stack: RunningStack) -> Iterator[tuple[str, subprocess.Popen]]:
    """(address, process) of a TP=4 x DCP=2 worker for the module; the last test kills one of its ranks."""
    with running_tp_worker(stack, *DCP_FLAGS, tp=TP) as worker:
        yield worker


@pytest.mark.slow
def test_dcp_worker_answers_greedy_like_the_engine_alone(stack, dcp_worker, reference) -> None:
    address, _ = dcp_worker
    ids = list(prompt(PROMPT_TOKENS, seed=11))
    assert stack.run(greedy_answer(address, ids, 24)) == reference.generate(ids, greedy(24)).token_ids
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0


async def _answer(address: str, ids: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens that came from the store's prefix cache."""
    client = DecodeClient(address)
    try:
        answer = await client.generate(
            build_request(ids, max_tokens=max_tokens, ignore_eos=True), timeout=120
        )
    finally:
        await client.close()
    return answer.token_ids, answer.summary.cached_prompt_tokens


@pytest.mark.slow
def test_dcp_worker_reads_a_cached_prefix_rank_by_rank_and_answers_as_the_engine_alone(
    stack, dcp_worker, reference
) -> None:
    # The second prompt extends the first: its leading 16-token blocks come from the first one's object,
    # the rest from its own; every DCP rank reads its blocks across both.
    address, _ = dcp_worker
    first = list(prompt(PROMPT_TOKENS, seed=21))
    second = first + list(prompt(40, seed=22))
    stack.run(_answer(address, first, 2))
    tokens, cached = stack.run(_answer(address, second, 16))
    assert cached == PROMPT_TOKENS // 16 * 16
    assert tokens == reference.generate(second, greedy(16)).token_ids
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0


@pytest.mark.slow
def test_killed_dcp_rank_ends_the_stream_unavailable_and_a_restarted_worker_serves(
    stack, dcp_worker, reference
) -> None:
    address, process = dcp_worker
    followers = follower_ranks(process.pid)
    assert len(followers) == TP - 1

    async def stream_until_killed() -> tuple[int, grpc.StatusCode, str]:
        client = DecodeClient(address)
        request = build_request(list(prompt(PROMPT_TOKENS, seed=5)), max_tokens=3000, ignore_eos=True)
        call = client.stream(request, timeout=120)
        received = 0
        try:
            async for message in call:
                received += len(message.delta.token_ids)
                if received == 4:  # mid-stream: TP rank 1, DCP rank 1 of the first pair, dies
                    os.kill(followers[0], signal.SIGKILL)
        except grpc.aio.AioRpcError as exc:
            return received, exc.code(), exc.details()
        finally:
            await client.close()
        return received, grpc.StatusCode.OK, ""

    received, code, details = stack.run(stream_until_killed())
    assert 4 <= received < 3000
    # Within its deadline: a hung collective would have ended DEADLINE_EXCEEDED after 120 s instead.
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "tensor-parallel group failed" in details
    # A worker that can only fail stops: it deregisters and exits 1 for its supervisor to restart.
    assert process.wait(60) == 1
    assert address not in [node.address for node in list_nodes(stack)]
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    with running_tp_worker(stack, *DCP_FLAGS, tp=TP) as (again, _):
        ids = list(prompt(40, seed=2))  # shorter than DCP blocks: rank 1 of each pair holds nothing yet
        assert stack.run(greedy_answer(again, ids, 8)) == reference.generate(ids, greedy(8)).token_ids
