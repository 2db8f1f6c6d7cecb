"""Batched prefill: several prompts in one forward on a PCP set equal the same prompts prefilled one by one.

Two real processes in a real gloo group (PCP=2) run four prompts of different lengths in one forward
(prefill.batch): one shorter than 2P chunks, ones that end inside a 16-token KV block, and one appended after
a held 32-token prefix that every rank first loads as an adopted replica (as prefix reuse loads cached
blocks). Each prompt's first-token logits and every row of its complete replica, on every rank, must equal
single-rank prefill of that prompt alone within 1e-5. The node's choice of the jobs one forward takes, and
their trip to every rank in one broadcast, are checked directly.
"""

from __future__ import annotations

import pytest
import torch

from pcpstack.engine.engine import Engine
from pcpstack.engine.kv_cache import blocks_needed
from pcpstack.engine.sampling import SamplingParams
from pcpstack.prefill.batch import BatchSplit, jobs_in_batch, pack_jobs, prefill_batch, unpack_jobs
from pcpstack.prefill.context_parallel import KvAllGather
from pcpstack.prefill.job import PrefillJob
from tests.prefill.cp_harness import (
    BLOCK_SIZE,
    assert_equal_to_single_rank,
    load_held_prefix,
    prefill_all,
    prompt,
    run_group,
)

TOL = 1e-5
PCP = 2
# 3 < 2P: one token per chunk, the last chunk empty. 45 and 200 end inside a block; 200 starts after a held
# prefix of 32 tokens. Not sorted, so a sequence's rows never sit where its length would put them.
LENGTHS = [45, 3, 200, 16]
HELD = {200: 32}


def batch_all(
    pcp_rank: int, pcp_size: int, model_name: str, lengths: list[int], held: dict[int, int]
) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """[(logits or None, replica)] for every length, all prefilled in one batched forward as rank pcp_rank."""
    torch.set_num_threads(1)
    total_blocks = sum(blocks_needed(n, BLOCK_SIZE) for n in lengths)
    engine = Engine.load(model_name, block_size=BLOCK_SIZE, num_blocks=total_blocks + 1)
    prompts = [prompt(engine.args.vocab_size, n) for n in lengths]
    starts = [held.get(n, 0) for n in lengths]
    for n, ids, start in zip(lengths, prompts, starts, strict=True):
        if start:
            load_held_prefix(engine, n, ids[:start])
    states = [engine.reserve(n, n) for n in lengths]
    split = BatchSplit(tuple(n - start for n, start in zip(lengths, starts, strict=True)), pcp_size)
    new = [ids[start:] for ids, start in zip(prompts, starts, strict=True)]
    logits = prefill_batch(engine, states, new, split, pcp_rank, KvAllGather(split), starts)
    return [(lg, engine.export_sequence(n).clone()) for lg, n in zip(logits, lengths, strict=True)]


def test_batch_split_gathers_every_sequence_in_position_order() -> None:
    # 1 token leaves rank 1 without a share of that sequence; 6 gives the ranks unequal shares.
    split = BatchSplit((5, 1, 6), 2)
    ids = torch.arange(split.num_tokens)  # each new token's row in the sequence-major order
    seq_starts = [0, 5, 6]
    shares = []
    for rank in range(2):
        mine = [
            start + p for s, start in zip(split.splits, seq_starts, strict=True) for p in s.positions(rank)
        ]
        padding = [-1] * (split.max_local_tokens - len(mine))
        shares.append(torch.tensor(mine + padding))
    assert split.local_counts(1) == [3, 0, 4]
    assert torch.equal(torch.cat(shares)[split.gather_index], ids)


def test_a_batch_takes_waiting_jobs_in_order_while_they_fit() -> None:
    def taken(lengths: list[int], max_jobs: int = 8, capacity_blocks: int = 100) -> int:
        return jobs_in_batch(lengths, max_jobs, 512, capacity_blocks, block_size=16)

    # Oldest first, always, even above every limit: it runs alone as it would without batching.
    assert taken([900, 10]) == 1
    # Stops at the first job that does not fit, so no job is overtaken by a later, smaller one.
    assert taken([100, 300, 200, 5]) == 2
    assert taken([10] * 20) == 8
    assert taken([10, 10], max_jobs=1) == 1
    # Each sequence takes whole blocks: three 17-token prompts need 6 blocks of 16.
    assert taken([17, 17, 17], capacity_blocks=5) == 2


def test_jobs_packed_for_the_broadcast_come_back_equal_and_in_order() -> None:
    jobs = [
        PrefillJob(f"req-{n}", f"key-{n}", list(range(n)), SamplingParams(), "127.0.0.1:1", 1000 + n)
        for n in (3, 1, 40)
    ]
    assert unpack_jobs(pack_jobs(jobs).clone()) == jobs


@pytest.mark.slow
def test_batched_pcp_prefill_of_four_prompts_equals_four_separate_prefills() -> None:
    reference = prefill_all("tiny", 0, 1, LENGTHS, group=False)
    ranks = run_group(PCP, batch_all, "tiny", LENGTHS, HELD)
    assert_equal_to_single_rank(reference, ranks, LENGTHS, PCP, TOL)
