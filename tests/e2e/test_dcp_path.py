"""Decode context parallelism through the whole request path, with SmolLM2 (9 query heads, 3 K/V heads) in
real processes, the stack started the way `pcpstack up --pcp 2 --decode-tp 9 --dcp 3` starts it.

A PCP=2 prefill set stores one replica object holding every K/V head; the decode worker's 9 ranks form three
DCP groups of three (one K/V head each), and each rank fetches only its own token blocks of its head with
ranged Gets. Greedy output for 32 tokens equals HF transformers' for a short chat prompt and for a prompt of
about 1,500 tokens (every rank then holds several blocks, the last one short), and nothing stays pinned in
the store afterwards. One stack serves both prompts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.test_generate import PROMPTS, check_greedy_against_hf
from tests.helpers import RunningStack, pinned_bytes, start_stack

# About 1,500 SmolLM2 tokens: 100 lines of about 15 tokens each.
LONG_PROMPT = "Summarise: " + " ".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(100)
)
DECODE_TP, DCP = 9, 3


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
@pytest.mark.parametrize("prompt", [PROMPTS[1], LONG_PROMPT], ids=["short-chat", "about-1500-tokens"])
def test_greedy_output_with_decode_tp9_dcp3_equals_hf_transformers(dcp_stack, hf_reference, prompt) -> None:
    check_greedy_against_hf(dcp_stack, hf_reference, [prompt])
    assert dcp_stack.run(pinned_bytes(dcp_stack.stack.kvstore_address)) == 0
