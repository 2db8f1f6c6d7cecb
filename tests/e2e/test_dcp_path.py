"""Decode context parallelism through the whole request path, in real processes, the stack started the way
`pcpstack up --pcp 2 --decode-tp 9 --dcp 3` starts it, against HF transformers.

The model is a random 2-layer Llama with SmolLM2's head layout (9 query heads, 3 K/V heads), saved as an HF
folder by transformers itself: the same split as SmolLM2 at TP=9 x DCP=3 (three DCP groups of three ranks,
one K/V head each), at a size nine rank processes load and run in seconds on two cores. (SmolLM2 itself at
TP=9 x DCP=3 takes over four minutes of the suite here: nine full model loads and ~2.7 s per decode step.)

A PCP=2 prefill set stores one replica object holding every K/V head; each decode rank fetches only its own
token blocks of its head with ranged Gets. Greedy output for 32 tokens equals transformers' for a prompt
shorter than one block (only DCP rank 0 holds any of it) and for one of about 1,500 tokens (every rank holds
several blocks, the last one short), and nothing stays pinned in the store afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.e2e.test_generate import check_greedy_against_hf
from tests.helpers import RunningStack, hf_greedy, pinned_bytes, small_hf_llama, start_stack

DECODE_TP, DCP = 9, 3
BLOCK_SIZE = 128  # the local stack's block size: 1,500 tokens are 12 blocks, four per DCP rank
VOCAB = 256  # small_hf_llama's


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


SHORT_PROMPT = _prompt(21, seed=1)
LONG_PROMPT = _prompt(1_501, seed=2)


@pytest.fixture(scope="module")
def dcp_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-shaped")
    reference = small_hf_llama(folder, heads=9, kv_heads=3, head_dim=16, layers=2, context=2048)
    return folder, hf_greedy(reference)


@pytest.fixture(scope="module")
def dcp_stack(tmp_path_factory, dcp_model) -> Iterator[RunningStack]:
    folder, _ = dcp_model
    stack = start_stack(
        tmp_path_factory.mktemp("stack-dcp"),
        pcp=2,
        decode_tp=DECODE_TP,
        dcp=DCP,
        model=str(folder),
        block_size=BLOCK_SIZE,
        # Nine rank processes on two cores can hold a node's heartbeat past the tests' usual 2 s lease.
        lease_s=10.0,
    )
    yield stack
    stack.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["shorter-than-a-block", "about-1500-tokens"]
)
def test_greedy_output_with_decode_tp9_dcp3_equals_hf_transformers(dcp_stack, dcp_model, prompt) -> None:
    _, reference = dcp_model
    check_greedy_against_hf(dcp_stack, reference, [prompt])
    assert dcp_stack.run(pinned_bytes(dcp_stack.stack.kvstore_address)) == 0
