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

from pcpstack.prefill.context_parallel import chunk_bounds
from tests.prefill.cp_harness import assert_equal_to_single_rank, prefill_all, run_pcp

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
    assert_equal_to_single_rank(reference, ranks, LENGTHS, PCP, TOL)
