"""Tensor parallelism through the whole request path, with SmolLM2 (9 query heads, 3 K/V heads) in real
processes, stacks started the way `pcpstack up --tp N --decode-tp N` starts them.

The replica a prefill set stores is cut by K/V head range over its TP ranks; a decode worker of another TP
size fetches the head ranges each of its ranks needs. Both directions of that resharding are checked: prefill
TP=3 x PCP=2 into decode TP=1 (three shards joined), and prefill TP=1 x PCP=2 into decode TP=3 (one object
read by head range). Greedy output for 32 tokens equals HF transformers', and nothing stays pinned in the
store afterwards (every shard of every replica was released).
"""

from __future__ import annotations

import pytest

from tests.e2e.test_generate import PROMPTS, check_greedy_against_hf
from tests.helpers import pinned_bytes, start_stack


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "prompt"),
    # One prompt each keeps two SmolLM2 TP stacks inside the suite's time: the long one (hundreds of tokens,
    # every rank a full share) where the prefill set is split most, a short one where decode's 32 steps run
    # on three ranks.
    [(3, 1, PROMPTS[2]), (1, 3, PROMPTS[0])],
    ids=["prefill-tp3-pcp2-into-decode-tp1", "prefill-tp1-pcp2-into-decode-tp3"],
)
def test_greedy_output_with_tensor_parallel_prefill_and_decode_equals_hf_transformers(
    prefill_tp: int, decode_tp: int, prompt: str, hf_reference, tmp_path
) -> None:
    stack = start_stack(tmp_path, pcp=2, tp=prefill_tp, decode_tp=decode_tp)
    try:
        check_greedy_against_hf(stack, hf_reference, [prompt])
        assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    finally:
        stack.stop()
