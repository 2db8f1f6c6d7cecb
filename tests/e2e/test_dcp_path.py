"""Decode context parallelism through the whole request path, with SmolLM2 (9 query heads, 3 K/V heads) in
real processes, the stack started the way `pcpstack up --pcp 2 --decode-tp 9 --dcp 3` starts it, against HF
transformers.

A PCP=2 prefill set stores one replica object holding every K/V head; the decode worker's 9 ranks form three
DCP groups of three (one K/V head each), and each rank fetches only its own token blocks of its head with
ranged Gets. A short chat prompt (under one 128-token block, so only DCP rank 0 of each group holds any of
it) and a prompt of about 1,500 tokens (12 blocks, four per DCP rank, the last one short) are sent at once,
so they also share decode steps while their lengths differ; each one's 32 greedy tokens equal transformers'.
Nothing stays pinned in the store afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.e2e.test_generate import PROMPTS, _answer
from tests.helpers import RunningStack, pinned_bytes, start_stack

# About 1,500 SmolLM2 tokens: 100 lines of about 15 tokens each.
LONG_PROMPT = "Summarise: " + " ".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(100)
)
DECODE_TP, DCP = 9, 3
BLOCK_SIZE = 128  # the local stack's
TOKENS = 32


@pytest.fixture(scope="module")
def dcp_stack(tmp_path_factory) -> Iterator[RunningStack]:
    # Nine busy decode ranks on two cores can hold a node's heartbeat past the tests' usual 2 s lease, which
    # would take the set out of routing between requests; a longer lease keeps it routable.
    stack = start_stack(
        tmp_path_factory.mktemp("stack-dcp"), pcp=2, decode_tp=DECODE_TP, dcp=DCP, lease_s=10.0
    )
    yield stack
    stack.stop()


@pytest.mark.slow
def test_greedy_output_with_decode_tp9_dcp3_equals_hf_transformers(dcp_stack, hf_reference) -> None:
    prompts = {"short chat": PROMPTS[1], "about 1,500 tokens": LONG_PROMPT}

    async def together():
        calls = (_answer(dcp_stack.decode, p, max_tokens=TOKENS, ignore_eos=True) for p in prompts.values())
        return await asyncio.gather(*calls)

    results = dict(zip(prompts, dcp_stack.run(together()), strict=True))
    lengths = {name: len(r.summary.prompt_token_ids) for name, r in results.items()}
    assert (
        lengths["short chat"] < BLOCK_SIZE
        and 11 * BLOCK_SIZE < lengths["about 1,500 tokens"] < 12 * BLOCK_SIZE
    )
    for name, result in results.items():
        assert result.summary.completion_tokens == TOKENS
        expected = hf_reference(list(result.summary.prompt_token_ids), TOKENS)
        assert result.token_ids == expected, f"{name} ({lengths[name]} prompt tokens)"
    assert dcp_stack.run(pinned_bytes(dcp_stack.stack.kvstore_address)) == 0
