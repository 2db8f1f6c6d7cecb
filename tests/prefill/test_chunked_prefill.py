"""Chunked prefill through the PCP path: new tokens appended after a prefix every rank already holds.

Each chunk is split by DualChunkSwap over the PCP ranks and attends to the chunks before it (already in
every rank's cache) and to itself at true positions; only its own K/V travel in the all-gather. Run chunk
after chunk, it must equal one-shot single-rank prefill: the same first-token logits and the same complete
replica on every rank, within 1e-4 on the tiny model at PCP=2, for prompt lengths not divisible by 2P and
chunks that end inside a KV block. One prompt starts from a prefix every rank loads as an adopted replica
first, as prefix reuse will load cached blocks: the same step, with a held start.
"""

from __future__ import annotations

import pytest
import torch

from pcpstack.prefill.context_parallel import chunk_bounds
from tests.prefill.cp_harness import prefill_all, run_pcp

TOL = 1e-4
PCP = 2
# Not a multiple of the harness's 16-token blocks: chunk boundaries fall inside blocks.
CHUNK_TOKENS = 120
# 243 = 120 + 120 + 3: the last chunk gives one rank a single token that is not the last position (it must
# still not see the other rank's later keys). 1031 starts from a held 256-token prefix (16 whole blocks, as
# cached blocks come) and runs the other 775 in seven chunks. Neither length divides by 2P.
LENGTHS = [243, 1031]
HELD = {1031: 256}


def test_chunk_bounds_cover_the_prompt_in_order() -> None:
    assert chunk_bounds(243, 120) == [range(0, 120), range(120, 240), range(240, 243)]
    assert chunk_bounds(243, 0) == [range(0, 243)]
    assert chunk_bounds(100, 120) == [range(0, 100)]


@pytest.mark.slow
def test_chunked_pcp_prefill_after_a_held_prefix_equals_one_shot_single_rank() -> None:
    reference = prefill_all("tiny", 0, 1, LENGTHS, group=False)
    ranks = run_pcp("tiny", PCP, LENGTHS, chunk_tokens=CHUNK_TOKENS, held=HELD)
    for i, n in enumerate(LENGTHS):
        ref_logits, ref_kv = reference[i]
        with_logits = [rank for rank in range(PCP) if ranks[rank][i][0] is not None]
        assert len(with_logits) == 1, f"n={n}: ranks {with_logits} returned logits"
        logits = ranks[with_logits[0]][i][0]
        err = (logits - ref_logits).abs().max().item()
        assert err <= TOL, f"n={n}: first-token logits differ by {err}"
        assert logits.argmax() == ref_logits.argmax()
        for rank in range(PCP):
            kv = ranks[rank][i][1]
            assert kv.shape == ref_kv.shape
            kv_err = (kv - ref_kv).abs().max().item()
            assert kv_err <= TOL, f"n={n} rank={rank}: K/V differ by {kv_err}"
        assert torch.equal(ranks[0][i][1], ranks[1][i][1]), f"n={n}: the ranks' replicas differ"
