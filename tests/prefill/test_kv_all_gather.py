"""The K/V all-gather of context-parallel prefill (KvAllGather) over a real gloo group: every rank hands in
the K/V rows of its DualChunkSwap share and gets back the whole prompt's (or a batch's) K/V in position
order, bit for bit, padding dropped."""

from __future__ import annotations

import pytest
import torch

from pcpstack.prefill.batch import BatchSplit
from pcpstack.prefill.context_parallel import KvAllGather
from pcpstack.prefill.split import DualChunkSplit
from tests.prefill.cp_harness import run_group

KV_HEADS, HEAD_DIM = 3, 8


def whole_kv(num_tokens: int) -> torch.Tensor:
    """[2, n, kv_heads, head_dim]: K and V of every position, the same on every rank."""
    generator = torch.Generator().manual_seed(num_tokens)
    return torch.randn(2, num_tokens, KV_HEADS, HEAD_DIM, generator=generator)


def local_rows(plan: DualChunkSplit | BatchSplit, pcp_rank: int) -> list[int]:
    """Rows of the whole K/V this rank computes, in its local order (a batch: sequence by sequence)."""
    if isinstance(plan, DualChunkSplit):
        return plan.positions(pcp_rank)
    rows, offset = [], 0
    for split in plan.splits:
        rows += [offset + p for p in split.positions(pcp_rank)]
        offset += split.num_tokens
    return rows


def _exchange(pcp_rank: int, pcp_size: int, batches: list[tuple[int, ...]]):
    results = []
    for lengths in batches:
        plan = DualChunkSplit(lengths[0], pcp_size) if len(lengths) == 1 else BatchSplit(lengths, pcp_size)
        kv = whole_kv(sum(lengths))
        rows = torch.tensor(local_rows(plan, pcp_rank), dtype=torch.long)
        k, v = KvAllGather(plan)(kv[0, rows], kv[1, rows])
        results.append((None, torch.stack((k, v))))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("pcp", [2, 3])
def test_every_rank_gets_the_whole_kv_in_position_order(pcp: int) -> None:
    # 1 and 2 leave ranks without tokens, 2P + 1 and 1031 pad the narrower shares; the tuples are batches.
    batches = [(1,), (2,), (2 * pcp,), (2 * pcp + 1,), (1031,), (5, 1, 64), (1, 2 * pcp + 3)]
    ranks = run_group(pcp, _exchange, batches)
    for rank in range(pcp):
        for lengths, (_, gathered) in zip(batches, ranks[rank], strict=True):
            assert torch.equal(gathered, whole_kv(sum(lengths))), f"rank {rank}, lengths {lengths}"
