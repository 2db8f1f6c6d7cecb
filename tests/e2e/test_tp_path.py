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

from pcpstack.decode.client import DecodeClient, build_request
from tests.e2e.test_generate import PROMPTS
from tests.helpers import pinned_bytes, start_stack

# A short prompt and a long one (hundreds of tokens, every rank a full share); test_generate's chat prompt
# would add little here for a third prefill through six ranks on two cores.
TP_PROMPTS = [PROMPTS[0], PROMPTS[2]]


async def _greedy(address: str, prompt: str):
    client = DecodeClient(address)
    try:
        return await client.generate(build_request(prompt, max_tokens=32, ignore_eos=True), timeout=300)
    finally:
        await client.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"),
    [(3, 1), (1, 3)],
    ids=["prefill-tp3-pcp2-into-decode-tp1", "prefill-tp1-pcp2-into-decode-tp3"],
)
def test_greedy_output_with_tensor_parallel_prefill_and_decode_equals_hf_transformers(
    prefill_tp: int, decode_tp: int, hf_reference, tmp_path
) -> None:
    stack = start_stack(tmp_path, pcp=2, tp=prefill_tp, decode_tp=decode_tp)
    try:
        for prompt in TP_PROMPTS:
            result = stack.run(_greedy(stack.decode, prompt))
            assert result.summary.completion_tokens == 32
            expected = hf_reference(list(result.summary.prompt_token_ids), 32)
            assert result.token_ids == expected, f"prompt {prompt!r:.60}"
        assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    finally:
        stack.stop()
