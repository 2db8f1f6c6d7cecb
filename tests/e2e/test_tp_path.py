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
store afterwards (every shard of every replica was released).
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_generate import check_greedy_against_hf
from tests.helpers import hf_greedy, pinned_bytes, small_hf_llama, start_stack

VOCAB = 256  # small_hf_llama's


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-shaped")
    reference = small_hf_llama(folder, heads=9, kv_heads=3, head_dim=16, layers=2, context=2048)
    return folder, hf_greedy(reference)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "prompt"),
    # A long prompt (every rank a full share of several blocks) where the prefill set is split most, a short
    # one where decode's 32 steps run on three ranks.
    [(3, 1, _prompt(700, seed=3)), (1, 3, _prompt(40, seed=4))],
    ids=["prefill-tp3-pcp2-into-decode-tp1", "prefill-tp1-pcp2-into-decode-tp3"],
)
def test_greedy_output_with_tensor_parallel_prefill_and_decode_equals_hf_transformers(
    prefill_tp: int, decode_tp: int, prompt: list[int], tp_model, tmp_path
) -> None:
    folder, reference = tp_model
    stack = start_stack(tmp_path, pcp=2, tp=prefill_tp, decode_tp=decode_tp, model=str(folder))
    try:
        check_greedy_against_hf(stack, reference, [prompt])
        assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    finally:
        stack.stop()
