"""The whole request path through real processes with SmolLM2: registry, kvstore, PCP prefill ranks, decode.

Greedy answers equal HF transformers' at PCP=2 (with TP in test_tp_path.py); concurrent requests equal the
same requests run alone; seeded sampling repeats; a cancelled request leaves nothing pinned in the store; a
request id can be sent again; a second chat turn takes the first turn's prompt blocks from the store and
answers as a cold run of another cache salt does; bad input (a request id that breaks the id rule
included) gets INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.prefix import PREFIX_BLOCK_TOKENS
from tests.helpers import pinned_bytes

PROMPTS = [
    "The history of the printing press",
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "Summarise: " + " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(30)),
]


async def _answer(address: str, prompt, cache_salt: str = "", **sampling):
    request = build_request(prompt, **sampling)
    request.cache_salt = cache_salt
    client = DecodeClient(address)
    try:
        return await client.generate(request, timeout=300)
    finally:
        await client.close()


# Whole-path parity with HF runs at PCP=2 here and with TP x PCP in test_tp_path.py; PCP=1 and PCP=3 prefill
# equal single-rank prefill in tests/prefill/test_cp_exact.py, and the engine equals HF in
# tests/engine/test_hf_parity.py (whole PCP=1 and PCP=3 stacks cost two minutes of the suite's 25).
@pytest.mark.slow
def test_greedy_output_equals_hf_transformers_pcp2(smollm_stack_pcp2, hf_reference) -> None:
    check_greedy_against_hf(smollm_stack_pcp2, hf_reference)


def check_greedy_against_hf(stack, hf_reference, prompts=tuple(PROMPTS)) -> None:
    for prompt in prompts:
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

    assert stack.run(cancel_midway()) >= 3
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    # The worker still serves after the cancellation.
    assert (
        stack.run(_answer(stack.decode, "Hello", max_tokens=4, ignore_eos=True)).summary.completion_tokens
        == 4
    )


@pytest.mark.slow
def test_requests_cancelled_before_their_first_token_leave_nothing_pinned(smollm_stack_pcp2) -> None:
    stack = smollm_stack_pcp2

    async def cancel_after(delay_s: float) -> None:
        client = DecodeClient(stack.decode)
        call = client.stream(build_request(PROMPTS[2], max_tokens=50, ignore_eos=True))
        await asyncio.sleep(delay_s)  # lands before Prefill is sent, while the set works, or as it answers
        call.cancel()
        await client.close()

    for delay_s in (0.0, 0.05, 0.2, 0.5, 1.0):
        stack.run(cancel_after(delay_s))
    # The set takes its jobs in order: once a later request is answered, the cancelled ones were too.
    follow_up = stack.run(_answer(stack.decode, "Hello", max_tokens=4, ignore_eos=True))
    assert follow_up.summary.completion_tokens == 4
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0


@pytest.mark.slow
def test_reused_request_id_is_served_each_time(smollm_stack_pcp2) -> None:
    # KV keys are per attempt, so a caller that re-sends an id gets an answer each time.
    stack = smollm_stack_pcp2
    answers = [
        stack.run(_answer(stack.decode, "Hello", request_id="again", max_tokens=4, ignore_eos=True))
        for _ in range(2)
    ]
    assert [a.summary.request_id for a in answers] == ["again", "again"]
    assert answers[0].token_ids == answers[1].token_ids and len(answers[0].token_ids) == 4


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
        ("Hi", {"request_id": "x" * 129}, "request_id is 129 characters; at most 128"),
        ("Hi", {"request_id": "two words"}, "request_id contains ' '"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(smollm_stack_pcp2, prompt, sampling, field) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        smollm_stack_pcp2.run(_answer(smollm_stack_pcp2.decode, prompt, **sampling))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


@pytest.mark.slow
def test_second_chat_turn_reuses_the_first_turns_prefix_blocks_and_answers_as_a_cold_run(
    smollm_stack_pcp2, hf_reference
) -> None:
    stack = smollm_stack_pcp2
    lines = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(20))
    system = {"role": "system", "content": lines}  # about 270 tokens: 16 full prefix blocks of 16
    turn_1 = [system, {"role": "user", "content": "Which animal jumps?"}]
    first = stack.run(_answer(stack.decode, turn_1, max_tokens=4, ignore_eos=True))
    hits_before = stack.run(_store_stat(stack)).prefix_blocks_hit
    turn_2 = [
        *turn_1,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And which one is lazy?"},
    ]
    warm = stack.run(_answer(stack.decode, turn_2, max_tokens=8, ignore_eos=True))
    cold = stack.run(_answer(stack.decode, turn_2, max_tokens=8, ignore_eos=True, cache_salt="tenant-b"))
    ids_1, ids_2 = list(first.summary.prompt_token_ids), list(warm.summary.prompt_token_ids)
    common = next((i for i, (a, b) in enumerate(zip(ids_1, ids_2, strict=False)) if a != b), len(ids_1))
    # The second turn's prefill computed only what follows the first turn's full blocks.
    assert warm.summary.cached_prompt_tokens == common // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS >= 256
    assert stack.run(_store_stat(stack)).prefix_blocks_hit > hits_before
    # Another salt shares no block: computed cold, and the answers are equal (and equal HF's).
    assert cold.summary.cached_prompt_tokens == 0
    assert warm.token_ids == cold.token_ids == hf_reference(ids_2, 8)


async def _store_stat(stack):
    async with KvStoreClient(stack.stack.kvstore_address) as store:
        return await store.stat()


@pytest.mark.slow
def test_each_replica_lands_in_the_segment_its_rank_announced_before_the_forward(smollm_stack_pcp2) -> None:
    """The owner rank tells the store its push's size when the forward starts, so the store readies a
    segment of that size and the rank maps it during the forward: every push lands in one, also when
    prompt lengths change from one request to the next (a standby sized after the last push would not
    fit). Each prompt here is new (a salt of its own), so the whole replica is pushed."""
    stack = smollm_stack_pcp2
    for index, lines in enumerate((16, 48, 16)):  # ~230, ~660, ~230 tokens: 10-30 MB replicas
        prompt = "Count: " + " ".join(
            f"Line {i}: a red fox runs past {index} tall trees." for i in range(lines)
        )
        before = stack.run(_store_stat(stack)).standby_puts
        result = stack.run(_answer(stack.decode, prompt, cache_salt=f"standby-{index}", max_tokens=2))
        assert result.summary.cached_prompt_tokens == 0
        assert stack.run(_store_stat(stack)).standby_puts == before + 1, f"prompt of {lines} lines"


@pytest.mark.slow
def test_every_rank_holds_a_standby_once_its_set_has_prefilled_a_size_twice(smollm_stack_pcp2) -> None:
    """Each request's replica is pushed by the PCP rank its id picks, so a rank that pushed none of the
    last requests would have to ready a segment during its next forward, out of the ranks' cores. Once
    the set has prefilled two prompts of the same length in a row, every rank tells the store to ready
    a standby of that size for its next push, pushing this time or not: the store's pool grows by one
    replica's size per rank (replicas stay in the store for prefix reuse, so no segment comes back)."""
    stack = smollm_stack_pcp2
    # ~1,400 tokens (65 MB replicas): longer than any prompt before it in this module, so no pooled
    # segment from earlier tests fits these sizes.
    text = " ".join(f"Line {i}: a grey owl sees {i % 7} mice." for i in range(120))
    before = stack.run(_store_stat(stack)).pooled_bytes
    tokens = set()
    for salt in ("twice-a", "twice-b"):
        result = stack.run(_answer(stack.decode, text, cache_salt=salt, max_tokens=2))
        assert result.summary.cached_prompt_tokens == 0
        tokens.add(result.summary.prompt_tokens)
    assert len(tokens) == 1
    # SmolLM2-135M's fp32 K/V: 30 layers x K and V x 3 K/V heads x 64 x 4 bytes a token.
    replica = tokens.pop() * 30 * 2 * 3 * 64 * 4
    deadline = time.monotonic() + 30  # the ranks ask after their replies, the store answers at once
    while (grown := stack.run(_store_stat(stack)).pooled_bytes - before) < 2 * replica:
        assert time.monotonic() < deadline, f"pool grew by {grown} bytes, want 2 standbys of {replica}"
        time.sleep(0.1)
    assert grown == 2 * replica
