"""Context-parallel prefill in real processes over a real gloo group equals single-rank prefill.

For PCP=2 and PCP=3, on the tiny model and on SmolLM2: the first-token logits and every layer's K/V (the
complete replica every rank holds) match single-rank prefill within 1e-4, for prompt lengths around the
chunking edges (1, 2, 3, 2P-1, 2P, 2P+1), 17, 257 and over 1000 tokens; and the replica bytes are the same
whichever rank would be selected to send them.
"""

from __future__ import annotations

import pytest
import torch

from pcpstack.prefill.split import DualChunkSplit
from tests.prefill.cp_harness import prefill_all, run_pcp

TOL = 1e-4


def lengths_for(pcp: int) -> list[int]:
    return sorted({1, 2, 3, 2 * pcp - 1, 2 * pcp, 2 * pcp + 1, 17, 257, 1031})


def check_against_single_rank(model_name: str | None, pcp: int) -> None:
    lengths = lengths_for(pcp)
    reference = prefill_all(model_name, 0, 1, lengths, group=False)
    ranks = run_pcp(model_name, pcp, lengths)
    assert sorted(ranks) == list(range(pcp))
    for i, n in enumerate(lengths):
        ref_logits, ref_kv = reference[i]
        owner = DualChunkSplit(n, pcp).last_position_owner()
        for rank in range(pcp):
            logits, kv = ranks[rank][i]
            assert kv.shape == ref_kv.shape
            kv_err = (kv - ref_kv).abs().max().item()
            assert kv_err <= TOL, f"n={n} rank={rank}: K/V differ by {kv_err}"
            if rank == owner:
                err = (logits - ref_logits).abs().max().item()
                assert err <= TOL, f"n={n}: logits differ by {err}"
                assert logits.argmax() == ref_logits.argmax()
            else:
                assert logits is None
        # Every rank holds the same complete replica, bit for bit: the sent bytes don't depend on the choice.
        first = ranks[0][i][1]
        for rank in range(1, pcp):
            assert torch.equal(ranks[rank][i][1], first), f"n={n}: replica of rank {rank} differs from rank 0"


@pytest.mark.slow
@pytest.mark.parametrize("pcp", [2, 3])
def test_tiny_model_pcp_equals_single_rank(pcp: int) -> None:
    check_against_single_rank("tiny", pcp)


@pytest.mark.slow
@pytest.mark.parametrize("pcp", [2, 3])
def test_smollm2_pcp_equals_single_rank(pcp: int) -> None:
    check_against_single_rank(None, pcp)
