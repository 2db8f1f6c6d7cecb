"""Tensor parallelism through the whole request path, in real processes, stacks started the way `pcpstack up
--tp N --decode-tp N` starts them.

The model is a random 2-layer Llama with SmolLM2's head layout (9 query heads, 3 K/V heads), saved as an HF
folder by transformers itself, so TP=3 splits it as it splits SmolLM2 (one K/V head per rank) at a size the
rank processes load and run in seconds on two cores. SmolLM2's own weights under TP=3 x PCP=2 are checked
against a single rank in tests/prefill/test_tp_exact.py.

The replica a prefill set stores is cut by K/V head range over its TP ranks; a decode worker of another TP
size fetches the head ranges each of its ranks needs. Both directions of that resharding are checked: prefill
TP=3 x PCP=2 into decode TP=1 (three shards joined), and prefill TP=1 x PCP=2 into decode TP=3 (one object
read by head range). Greedy output for 32 tokens equals HF transformers', and nothing stays pinned in the
store afterwards (every shard of every replica was released). With prefill TP=3 prefix reuse works per
shard: a second prompt extending the first takes the blocks all three shards hold and computes only the
rest, and answers as HF does.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pcpstack.kvstore.prefix import PREFIX_BLOCK_TOKENS
from tests.e2e.test_generate import _answer, _store_stat, check_greedy_against_hf
from tests.helpers import RunningStack, hf_greedy, pinned_bytes, prefix_leases, small_hf_llama, start_stack

VOCAB = 256  # small_hf_llama's


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-shaped")
    reference = small_hf_llama(folder, heads=9, kv_heads=3, head_dim=16, layers=2, context=2048)
    return folder, hf_greedy(reference)


@pytest.fixture(scope="module")
def tp3_stack(tp_model, tmp_path_factory) -> Iterator[RunningStack]:
    """Prefill TP=3 x PCP=2 into decode TP=1: SmolLM2's served shape, one stack for the tests that use it."""
    folder, _ = tp_model
    stack = start_stack(tmp_path_factory.mktemp("tp3"), pcp=2, tp=3, decode_tp=1, model=str(folder))
    yield stack
    stack.stop()


# A long prompt (every rank a full share of several blocks) where the prefill set is split most.
@pytest.mark.slow
def test_greedy_output_with_prefill_tp3_pcp2_into_decode_tp1_equals_hf_transformers(
    tp3_stack, tp_model
) -> None:
    check_greedy_against_hf(tp3_stack, tp_model[1], [_prompt(700, seed=3)])
    assert tp3_stack.run(pinned_bytes(tp3_stack.stack.kvstore_address)) == 0


# A short prompt where decode's 32 steps run on three ranks.
@pytest.mark.slow
def test_greedy_output_with_prefill_tp1_pcp2_into_decode_tp3_equals_hf_transformers(
    tp_model, tmp_path
) -> None:
    folder, reference = tp_model
    stack = start_stack(tmp_path, pcp=2, tp=1, decode_tp=3, model=str(folder))
    try:
        check_greedy_against_hf(stack, reference, [_prompt(40, seed=4)])
        assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    finally:
        stack.stop()


@pytest.mark.slow
def test_with_prefill_tp3_a_second_prompt_sharing_a_prefix_computes_only_its_new_tokens_and_equals_hf(
    tp3_stack, tp_model
) -> None:
    stack, reference = tp3_stack, tp_model[1]
    turn_1 = _prompt(300, seed=5)  # 18 full prefix blocks, stored as three shards (one K/V head each)
    turn_2 = turn_1 + _prompt(50, seed=6)
    stack.run(_answer(stack.decode, turn_1, max_tokens=2, ignore_eos=True))
    hits_before = stack.run(_store_stat(stack)).prefix_blocks_hit
    warm = stack.run(_answer(stack.decode, turn_2, max_tokens=16, ignore_eos=True))
    # Every shard held turn 1's 18 blocks: the set computed only the 62 tokens after them.
    assert warm.summary.cached_prompt_tokens == 300 // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS == 288
    assert stack.run(_store_stat(stack)).prefix_blocks_hit - hits_before == 18
    assert warm.token_ids == reference(turn_2, 16)
    # Every replica shard released, and the prefix lease over the three shards' blocks too.
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    assert stack.run(prefix_leases(stack.stack.kvstore_address)) == 0
