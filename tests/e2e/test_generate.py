"""The whole request path through real processes with SmolLM2: registry, kvstore, PCP prefill ranks, decode.

Greedy answers equal HF transformers' for PCP=1, 2 and 3; concurrent requests equal the same requests run
alone; seeded sampling repeats; a cancelled request leaves nothing pinned in the store; bad input gets
INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.kvstore.client import KvStoreClient
from tests.helpers import start_stack

PROMPTS = [
    "The history of the printing press",
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "Summarise: " + " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(30)),
]


async def _answer(address: str, prompt, **sampling):
    client = DecodeClient(address)
    try:
        return await client.generate(build_request(prompt, **sampling), timeout=300)
    finally:
        await client.close()


@pytest.mark.slow
@pytest.mark.parametrize("pcp", [1, 3])
def test_greedy_output_equals_hf_transformers(pcp: int, hf_reference, tmp_path) -> None:
    stack = start_stack(tmp_path, pcp=pcp)
    try:
        check_greedy_against_hf(stack, hf_reference)
    finally:
        stack.stop()


@pytest.mark.slow
def test_greedy_output_equals_hf_transformers_pcp2(smollm_stack_pcp2, hf_reference) -> None:
    check_greedy_against_hf(smollm_stack_pcp2, hf_reference)


def check_greedy_against_hf(stack, hf_reference) -> None:
    for prompt in PROMPTS:
        result = stack.run(_answer(stack.decode, prompt, max_tokens=32, ignore_eos=True))
        assert result.summary.completion_tokens == 32
        expected = hf_reference(list(result.summary.prompt_token_ids), 32)
        assert result.token_ids == expected, f"prompt {prompt!r:.60}"


@pytest.mark.slow
def test_eight_concurrent_requests_equal_running_them_alone(smollm_stack_pcp2) -> None:
    stack = smollm_stack_pcp2
    prompts = [f"Tell me fact number {i} about the ocean." for i in range(8)]
    alone = [stack.run(_answer(stack.decode, p, max_tokens=12, ignore_eos=True)).token_ids for p in prompts]

    async def together():
        return await asyncio.gather(
            *(_answer(stack.decode, p, max_tokens=12, ignore_eos=True) for p in prompts)
        )

    assert [r.token_ids for r in stack.run(together())] == alone


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(smollm_stack_pcp2) -> None:
    stack = smollm_stack_pcp2
    runs = [
        stack.run(
            _answer(stack.decode, "Once upon a time", max_tokens=16, temperature=0.8, top_p=0.9, seed=42)
        )
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    other = stack.run(
        _answer(stack.decode, "Once upon a time", max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    )
    assert other.token_ids != runs[0].token_ids


@pytest.mark.slow
def test_cancelled_request_leaves_nothing_pinned(smollm_stack_pcp2) -> None:
    stack = smollm_stack_pcp2

    async def cancel_midway() -> int:
        client = DecodeClient(stack.decode)
        call = client.stream(
            build_request("Write a long story about a robot.", max_tokens=400, ignore_eos=True)
        )
        received = 0
        async for message in call:
            received += len(message.delta.token_ids)
            if received >= 3:
                call.cancel()
                break
        await client.close()
        return received

    async def pinned_bytes() -> int:
        async with KvStoreClient(stack.stack.kvstore_address) as store:
            for _ in range(50):
                stat = await store.stat()
                if stat.pinned_bytes == 0:
                    return 0
                await asyncio.sleep(0.1)
            return stat.pinned_bytes

    assert stack.run(cancel_midway()) >= 3
    assert stack.run(pinned_bytes()) == 0
    # The worker still serves after the cancellation.
    assert (
        stack.run(_answer(stack.decode, "Hello", max_tokens=4, ignore_eos=True)).summary.completion_tokens
        == 4
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ("", {}, "text"),
        ("Hi", {"max_tokens": 0}, "sampling.max_tokens"),
        ("Hi", {"temperature": -1.0}, "sampling.temperature"),
        ("Hi", {"top_p": 1.5}, "sampling.top_p"),
        ("Hi", {"max_tokens": 10_000_000}, "sampling.max_tokens"),
        ("Hi", {"model": "gpt-9"}, "model"),
        ([10**9], {}, "token_ids"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(smollm_stack_pcp2, prompt, sampling, field) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        smollm_stack_pcp2.run(_answer(smollm_stack_pcp2.decode, prompt, **sampling))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
