"""DualChunkSwap split and replica selection as pure functions."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pcpstack.prefill.replica import replica_owner
from pcpstack.prefill.split import DualChunkSplit


def test_eight_tokens_over_two_ranks_pair_first_and_last_chunks() -> None:
    split = DualChunkSplit(8, 2)
    assert split.chunk_size == 2
    assert split.positions(0) == [0, 1, 6, 7]
    assert split.positions(1) == [2, 3, 4, 5]


def test_short_prompt_leaves_tail_chunks_empty() -> None:
    split = DualChunkSplit(3, 3)  # 6 chunks of 1 token; chunks 3..5 are empty
    assert [split.positions(r) for r in range(3)] == [[0], [1], [2]]
    assert split.max_local_tokens == 1
    assert split.last_position_owner() == 2


def test_ten_tokens_over_three_ranks_has_a_short_last_chunk() -> None:
    split = DualChunkSplit(10, 3)  # chunk size 2: [0,1] [2,3] [4,5] [6,7] [8,9] []
    assert split.positions(0) == [0, 1]
    assert split.positions(1) == [2, 3, 8, 9]
    assert split.positions(2) == [4, 5, 6, 7]
    assert split.last_position_owner() == 1


@given(st.integers(1, 5000), st.integers(1, 8))
def test_ranks_cover_every_position_exactly_once(n: int, pcp: int) -> None:
    split = DualChunkSplit(n, pcp)
    covered = sorted(p for r in range(pcp) for p in split.positions(r))
    assert covered == list(range(n))
    assert split.positions(split.last_position_owner()).count(n - 1) == 1


@given(st.integers(1, 3000), st.integers(1, 6))
def test_gather_index_restores_position_order(n: int, pcp: int) -> None:
    split = DualChunkSplit(n, pcp)
    padded = torch.full((pcp * split.max_local_tokens,), -1)
    for rank in range(pcp):
        local = torch.tensor(split.positions(rank), dtype=torch.long)
        padded[rank * split.max_local_tokens : rank * split.max_local_tokens + len(local)] = local
    assert padded[split.gather_index].tolist() == list(range(n))


@given(st.integers(64, 5000), st.integers(2, 8))
def test_causal_work_is_balanced_between_ranks(n: int, pcp: int) -> None:
    split = DualChunkSplit(n, pcp)
    work = [sum(p + 1 for p in split.positions(r)) for r in range(pcp)]
    # Padded to 2P full chunks every pair of chunks has equal causal work; the real imbalance is at most the
    # work of the padding positions [n, 2P * chunk) that the short tail lacks.
    padded_end = 2 * pcp * split.chunk_size
    assert max(work) - min(work) <= sum(p + 1 for p in range(n, padded_end))


def test_replica_owner_matches_the_sha256_formula_for_fixed_ids() -> None:
    for request_id in ("req-0", "req-1", "hello", ""):
        digest = hashlib.sha256(request_id.encode()).digest()
        for pcp in (1, 2, 3, 8):
            assert replica_owner(request_id, pcp) == int.from_bytes(digest[:8], "little") % pcp
    # Pinned values, so a change of formula (or of byte order) is caught.
    assert [replica_owner(f"req-{i}", 3) for i in range(6)] == [1, 1, 2, 2, 1, 2]
    assert replica_owner("hello", 2) == 0


def test_replica_owner_refuses_a_bad_size() -> None:
    with pytest.raises(ValueError, match="pcp_size=0"):
        replica_owner("x", 0)
