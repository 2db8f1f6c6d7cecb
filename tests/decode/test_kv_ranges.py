"""A DCP rank's part of a replica read with ranged Gets from a real store equals the slice of the whole
replica it stands for (its K/V heads at its owned token positions), whatever the replica's shards, and when
its leading tokens are a cached prefix held by other requests' objects."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pcpstack.decode.kv_ranges import (
    KvSource,
    assemble_part,
    fold_runs,
    part_reads,
    prefix_sources,
    shard_sources,
)
from pcpstack.engine.dcp import DcpShard, KvPart
from pcpstack.engine.kv_cache import KvLayout
from pcpstack.kvstore.client import KvStoreClient
from tests.kvstore.conftest import running_store

# Three K/V heads as SmolLM2 has; blocks of 4 tokens; a worker of TP=9 x DCP=3 (rank r: head r // 3).
LAYOUT = KvLayout("m", num_layers=2, num_kv_heads=3, head_dim=8, dtype="bfloat16", block_size=4)
TP, DCP = 9, 3


def _parts(num_tokens: int) -> list[KvPart]:
    """The parts of a TP=9 DCP=3 worker, as its engine's kv_parts lays them out."""
    per_head = TP // LAYOUT.num_kv_heads
    return [
        KvPart(
            rank,
            range(rank // per_head, rank // per_head + 1),
            DcpShard(rank % DCP, DCP, 4).owned_runs(num_tokens),
        )
        for rank in range(TP)
    ]


def test_runs_of_one_length_at_one_spacing_fold_into_one():
    runs = DcpShard(1, 3, 4).owned_runs(30)  # blocks 1, 4 full; block 7 (28..29) short
    folds = fold_runs(runs)
    assert [(f.start, f.length, f.spacing, f.count) for f in folds] == [(4, 4, 12, 2), (28, 2, 0, 1)]


@pytest.mark.parametrize(
    "shard_heads", [[range(0, 3)], [range(0, 1), range(1, 2), range(2, 3)]], ids=["one", "per-head"]
)
@pytest.mark.parametrize(
    "num_tokens", [37, 24, 5]
)  # not a block multiple, a multiple of D blocks, < D blocks
@pytest.mark.timeout(60)
def test_every_ranks_ranged_part_equals_its_slice_of_the_replica(shard_heads, num_tokens):
    replica = torch.randn(LAYOUT.num_layers, 2, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(
        torch.bfloat16
    )

    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            stored = []
            for i, heads in enumerate(shard_heads):
                shard = replica[:, :, :, heads.start : heads.stop].contiguous()
                stored.append(await client.put(f"s{i}", "fp", shard.view(torch.uint8).numpy()))
            sent_before = (await client.stat()).bytes_out
            for part in _parts(num_tokens):
                reads = part_reads(part, shard_sources(shard_heads, num_tokens), LAYOUT)
                assert all(len(read.ranges) <= 2 for read in reads)  # full blocks, then a short one
                data = [
                    (
                        await client.get(
                            f"s{r.shard_index}", "fp", stored[r.shard_index].capability, ranges=r.ranges
                        )
                    )[0]
                    for r in reads
                ]
                got = assemble_part(part, reads, data, LAYOUT)
                positions = torch.tensor([p for run in part.positions for p in run], dtype=torch.long)
                want = replica[:, :, :, part.kv_heads.start : part.kv_heads.stop].index_select(2, positions)
                assert torch.equal(got, want), f"TP rank {part.tp_rank}"
            # Each rank read one head of its own blocks: the nine ranks together read the replica once.
            assert (await client.stat()).bytes_out - sent_before == replica.numel() * 2

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_a_part_read_across_a_cached_prefix_and_the_new_shards_equals_its_slice():
    # 37 tokens: 9 from an earlier object (its tokens 4..12), 12 from another (its tokens 0..11), then 16
    # new tokens stored per head; block edges fall inside and across the windows.
    num_tokens = 37
    replica = torch.randn(LAYOUT.num_layers, 2, num_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(
        torch.bfloat16
    )
    older_a = torch.randn(LAYOUT.num_layers, 2, 20, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16)
    older_a[:, :, 4:13] = replica[:, :, 0:9]
    older_b = torch.randn(LAYOUT.num_layers, 2, 12, LAYOUT.num_kv_heads, LAYOUT.head_dim).to(torch.bfloat16)
    older_b[:, :, 0:12] = replica[:, :, 9:21]
    heads = [range(h, h + 1) for h in range(LAYOUT.num_kv_heads)]
    all_heads = range(LAYOUT.num_kv_heads)
    sources = [KvSource(0, 9, all_heads, 20, 4), KvSource(9, 12, all_heads, 12, 0)]
    sources += shard_sources(heads, 16, start=21)
    objects = [older_a, older_b] + [replica[:, :, 21:, h.start : h.stop] for h in heads]

    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            stored = [
                await client.put(f"o{i}", "fp", o.contiguous().view(torch.uint8).numpy())
                for i, o in enumerate(objects)
            ]
            for part in _parts(num_tokens):
                reads = part_reads(part, sources, LAYOUT)
                data = [
                    (await client.get(f"o{r.shard_index}", "fp", stored[r.shard_index].capability, r.ranges))[
                        0
                    ]
                    for r in reads
                ]
                got = assemble_part(part, reads, data, LAYOUT)
                positions = torch.tensor([p for run in part.positions for p in run], dtype=torch.long)
                want = replica[:, :, :, part.kv_heads.start : part.kv_heads.stop].index_select(2, positions)
                assert torch.equal(got, want), f"TP rank {part.tp_rank}"

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_a_prefix_stored_per_head_range_with_runs_ending_apart_reads_back_as_its_slice():
    # A TP prefill set's prefix of 21 tokens: head 0's in one object (its tokens 4..24), heads 1-2's in two
    # (tokens 0..8 of one, then 3..15 of another), so their runs end at different tokens. Read rank by rank
    # (DCP) and as one part of every head and position (decode without DCP).
    cached = 21
    shape = (LAYOUT.num_layers, 2, cached, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    replica = torch.randn(shape).to(torch.bfloat16)

    def older(tokens: int, heads: range, at: int, window: range) -> torch.Tensor:
        shape = (LAYOUT.num_layers, 2, tokens, len(heads), LAYOUT.head_dim)
        obj = torch.randn(shape).to(torch.bfloat16)
        obj[:, :, at : at + len(window)] = replica[:, :, window.start : window.stop, heads.start : heads.stop]
        return obj

    head0, rest = range(0, 1), range(1, 3)
    # in the handle's order: each head range's runs in sequence order (their starts are placed by it)
    objects = [
        older(8, rest, 0, range(0, 8)),
        older(30, head0, 4, range(0, 21)),
        older(16, rest, 3, range(8, 21)),
    ]
    runs = [KvSource(0, 8, rest, 8, 0), KvSource(0, 21, head0, 30, 4), KvSource(0, 13, rest, 16, 3)]
    placed = prefix_sources(runs, LAYOUT.num_kv_heads, cached)
    assert [(i, s.start, s.count, s.offset) for i, s in placed] == [
        (1, 0, 8, 4),
        (0, 0, 8, 0),
        (1, 8, 13, 12),
        (2, 8, 13, 3),
    ]
    sources = [source for _, source in placed]
    whole = KvPart(0, range(LAYOUT.num_kv_heads), (range(cached),))

    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            stored = [
                await client.put(f"o{i}", "fp", o.contiguous().view(torch.uint8).numpy())
                for i, o in enumerate(objects)
            ]
            for part in [*_parts(cached), whole]:
                reads = part_reads(part, sources, LAYOUT)
                data = []
                for r in reads:
                    index = placed[r.shard_index][0]
                    data.append((await client.get(f"o{index}", "fp", stored[index].capability, r.ranges))[0])
                got = assemble_part(part, reads, data, LAYOUT)
                positions = torch.tensor([p for run in part.positions for p in run], dtype=torch.long)
                want = replica[:, :, :, part.kv_heads.start : part.kv_heads.stop].index_select(2, positions)
                assert torch.equal(got, want), f"TP rank {part.tp_rank}"

    asyncio.run(body())


def test_a_prefix_missing_a_head_range_or_tokens_of_one_is_refused():
    with pytest.raises(ValueError, match="end at head 1"):
        prefix_sources([KvSource(0, 8, range(0, 1), 8)], LAYOUT.num_kv_heads, 8)
    short = [KvSource(0, 8, range(0, 1), 8), KvSource(0, 4, range(1, 3), 8)]
    with pytest.raises(ValueError, match="heads 1-3 holds 4 tokens, not 8"):
        prefix_sources(short, LAYOUT.num_kv_heads, 8)
