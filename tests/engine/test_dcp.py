"""Decode context parallelism (engine.dcp) in real processes over a real gloo group.

The tiny model (4 query heads, 2 K/V heads) at TP=4 replicates each K/V head on two ranks; DCP=2 splits the
tokens of that head between them instead, token block b on DCP rank b % 2. Decode then equals the plain
single-rank Engine within 1e-4, each rank holds half the blocks of a long sequence, and a killed DCP rank
makes the next step raise Unavailable. The merge of partial attentions is checked on its own against full
attention.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pcpstack.common.errors import Unavailable
from pcpstack.engine.dcp import DcpShard, attention_with_lse, merge_partial_attention
from pcpstack.engine.engine import Engine
from pcpstack.engine.tp_engine import TensorParallelEngine

TOL = 1e-4
# Small blocks so that short sequences still span several blocks of both DCP ranks.
BLOCK_SIZE = 4
NUM_BLOCKS = 1100
TP, DCP = 4, 2
STEPS = 32
# Prompt lengths: not multiples of the block size; "short" is shorter than one block (DCP rank 1 holds none
# of it until it grows), "five" shorter than D blocks.
LENGTHS = {"short": 3, "five": 5, "mid": 23, "long": 42}


def start_dcp() -> TensorParallelEngine:
    """A float32 TP=4, DCP=2 engine over the tiny model, one torch thread per rank."""
    return TensorParallelEngine.start(
        "tiny",
        TP,
        dtype=torch.float32,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        # Short: a killed rank surfaces fast even where a collective, not the liveness check, meets it.
        timeout_s=20.0,
        threads=1,
        dcp_size=DCP,
    )


@pytest.fixture(scope="module")
def engines() -> Iterator[list[TensorParallelEngine]]:
    """The module's DCP engine, shared by its tests (one torch.distributed world per process: one engine at
    a time); the TP engine sets this process's torch threads, restored after."""
    threads = torch.get_num_threads()
    holder = [start_dcp()]
    yield holder
    holder[0].close()
    torch.set_num_threads(threads)


@pytest.fixture
def dcp_engine(engines: list[TensorParallelEngine]) -> TensorParallelEngine:
    """The shared engine, restarted if a test killed one of its ranks (the kill test comes last, so in file
    order it never restarts)."""
    try:
        engines[0].blocks_in_use()
    except Unavailable:
        engines[0].close()
        engines[0] = start_dcp()
    return engines[0]


def test_shard_arithmetic_splits_every_position_once_in_block_order() -> None:
    n = 4 * 7 + 3
    shards = [DcpShard(rank, 3, 4) for rank in range(3)]
    owned = [s.owned_positions(n).tolist() for s in shards]
    assert sorted(p for positions in owned for p in positions) == list(range(n))
    for shard, positions in zip(shards, owned, strict=True):
        assert shard.local_count(n) == len(positions)
        assert [shard.local_index(p) for p in positions] == list(range(len(positions)))
        assert all(shard.owns(p) and (p // 4) % 3 == shard.rank for p in positions)
        assert all(len(run) <= 4 for run in shard.owned_runs(n))
    assert [s.blocks_for(n) for s in shards] == [3, 3, 2]


def test_merge_partial_attention_equals_full_attention_including_a_rank_without_keys() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, group, head_dim, ctx = 3, 2, 3, 16, 11
    q = torch.randn(batch, kv_heads, group, head_dim, generator=gen)
    keys = torch.randn(batch, ctx, kv_heads, head_dim, generator=gen)
    values = torch.randn(batch, ctx, kv_heads, head_dim, generator=gen)
    # Three disjoint key sets: the first 4 keys, none, the other 7.
    splits = [(0, 4), (4, 4), (4, ctx)]
    outs, lses = [], []
    for start, stop in splits:
        count = torch.full((batch,), stop - start)
        out, lse = attention_with_lse(q, keys[:, start:stop], values[:, start:stop], count)
        outs.append(out)
        lses.append(lse)
    assert torch.isinf(lses[1]).all() and (lses[1] < 0).all(), "a set without keys has lse -inf"
    outs[1] = torch.full_like(outs[1], float("nan"))  # whatever it holds must not leak into the merge
    merged = merge_partial_attention(torch.stack(outs), torch.stack(lses))
    full = F.scaled_dot_product_attention(
        q.flatten(1, 2)[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), enable_gqa=True
    ).view(batch, kv_heads, group, head_dim)  # [B, kv_heads * G, 1, D]: one query row per head
    assert (merged - full).abs().max().item() <= 1e-5


def test_dcp2_decode_equals_the_single_engine_over_32_steps(tiny, dcp_engine) -> None:
    reference = Engine(tiny, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    assert dcp_engine.dcp_size == DCP and reference.dcp_size == 1
    assert dcp_engine.layout.fingerprint() == reference.layout.fingerprint()
    tokens: dict[str, int] = {}
    for name, length in LENGTHS.items():
        prompt = torch.randint(0, 200, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        tokens[name] = int(reference.prefill(name, prompt).argmax())
        kv = reference.export_sequence(name)
        if name == "mid":
            # Cut as kv_parts says (what the decode batcher does with ranged store reads).
            parts = [
                kv[:, :, [p for run in part.positions for p in run]][:, :, :, part.kv_heads]
                for part in dcp_engine.kv_parts(length)
            ]
            dcp_engine.adopt_parts(name, parts, length)
        else:
            dcp_engine.adopt_sequence(name, kv, length)
    for step in range(STEPS):
        names = list(tokens)
        expected = reference.decode_step(names, [tokens[n] for n in names])
        got = dcp_engine.decode_step(names, [tokens[n] for n in names])
        err = (got - expected).abs().max().item()
        assert err <= TOL, f"step {step}, batch {names}: logits differ by {err}"
        tokens = {n: int(t) for n, t in zip(names, expected.argmax(-1).tolist(), strict=True)}
        if step == STEPS // 2:
            dcp_engine.free("mid")
            reference.free("mid")
            del tokens["mid"]
    for name in tokens:
        dcp_engine.free(name)
    assert dcp_engine.blocks_in_use() == [0] * TP


def test_each_dcp_rank_holds_half_the_blocks_of_a_4096_token_sequence(tiny, dcp_engine) -> None:
    reference = Engine(tiny, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    layout = reference.layout
    length = 4095
    kv = torch.randn(layout.num_layers, 2, length, layout.num_kv_heads, layout.head_dim) * 0.1
    before = dcp_engine.blocks_in_use()  # whatever an earlier test left behind
    reference.adopt_sequence("long", kv, length)
    dcp_engine.adopt_sequence("long", kv, length)
    # The step that makes it 4,096 tokens allocates the last block on the rank that owns it.
    reference.decode_step(["long"], [1])
    dcp_engine.decode_step(["long"], [1])
    whole = reference.allocator.num_blocks - reference.allocator.num_free
    assert whole == 4096 // BLOCK_SIZE == reference.blocks_for(4096)
    held = [after - was for after, was in zip(dcp_engine.blocks_in_use(), before, strict=True)]
    assert held == [whole // DCP] * TP
    assert dcp_engine.blocks_for(4096) == whole // DCP
    dcp_engine.free("long")


def test_killed_dcp_rank_makes_the_next_step_raise_unavailable(tiny, dcp_engine) -> None:
    reference = Engine(tiny, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    reference.prefill("x", list(range(1, 12)))
    dcp_engine.adopt_sequence("x", reference.export_sequence("x"), 11)
    dcp_engine.decode_step(["x"], [3])
    # TP rank 1: the leader's DCP partner, holding the other half of its K/V head's tokens.
    os.kill(dcp_engine.follower_pids[0], signal.SIGKILL)
    with pytest.raises(Unavailable, match="tensor-parallel group failed"):
        dcp_engine.decode_step(["x"], [4])
    with pytest.raises(Unavailable):
        dcp_engine.decode_step(["x"], [5])
    dcp_engine.free("x")
