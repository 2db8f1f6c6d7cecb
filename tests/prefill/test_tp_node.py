"""A real prefill node running TP=2 x PCP=2 (four rank processes, real gloo groups) on the tiny model, with
a real registry and KV store on loopback.

The tiny model has 4 query heads and 2 K/V heads, so each TP rank holds one K/V head: the owning PCP rank's
TP group stores the replica as two objects, one per head. Fetched with each shard's own key, fingerprint
and capability and placed by head range they give single-rank prefill's KV, and the first token is
single-rank prefill's. A prompt extending a stored one takes its prefix per head (each shard's blocks under
its own fingerprint), computes only the rest, and the prefix and new shards together are still
single-rank prefill's KV.
"""

from __future__ import annotations

import pytest
import torch

from pcpstack.engine.config import ModelArgs
from pcpstack.engine.engine import Engine
from pcpstack.engine.parallel import TensorParallelShard, shard_fingerprint
from pcpstack.engine.sampling import SamplingParams
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.prefix import segment_range
from pcpstack.prefill.client import PrefillClient
from pcpstack.prefill.job import PrefillJob, ReplicaShard, replica_shards, shard_holding
from pcpstack.prefill.replica import replica_owner
from tests.helpers import pinned_bytes, start_stack
from tests.prefill.test_service import BLOCK_SIZE, GREEDY, prefill_address, prompt, single_rank

TP, PCP = 2, 2
TINY = ModelArgs.tiny()  # 4 query heads, 2 K/V heads


@pytest.fixture(scope="module")
def reference() -> Engine:
    return Engine.load("tiny", block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(tmp_path_factory.mktemp("prefill-tp-stack"), tp=TP, pcp=PCP, decode=0, model="tiny")
    yield running
    running.stop()


async def prefill_and_fetch_shards(stack, request_id: str, ids: list[int]):
    """The Prefill reply and, for each KvShard of its handle, the shard's K/V [layers, 2, n, heads, hd]."""
    client = PrefillClient(prefill_address(stack))
    try:
        reply = await client.prefill(request_id, ids, GREEDY, timeout=60)
    finally:
        await client.close()
    layout, shards = reply.kv.layout, []
    async with KvStoreClient(reply.kv.store_address) as store:
        for shard in reply.kv.shards:
            data, _ = await store.get(shard.key, shard.fingerprint, shard.capability)
            await store.release(shard.key, shard.capability)
            heads = shard.kv_head_end - shard.kv_head_start
            kv = torch.frombuffer(bytearray(data), dtype=torch.float32)
            shards.append(kv.view(layout.num_layers, 2, reply.kv.num_tokens, heads, layout.head_dim))
    return reply, shards


def test_replica_shards_store_each_kv_head_once_from_its_first_holder() -> None:
    kv_key, fp = "req.abc/" + "f" * 16, "f" * 64
    # tp 1: the replica itself, exactly as before TP
    assert replica_shards(kv_key, fp, TINY, 1) == (ReplicaShard(0, 0, 2, kv_key, fp),)
    # tp 4 replicates each K/V head on two ranks: ranks 0 and 2 store heads 0 and 1
    shards = replica_shards(kv_key, fp, TINY, 4)
    assert [(s.tp_rank, s.kv_head_start, s.kv_head_end) for s in shards] == [(0, 0, 1), (2, 1, 2)]
    assert [s.fingerprint for s in shards] == [shard_fingerprint(fp, range(h, h + 1), 2) for h in (0, 1)]
    assert [s.key.split("/")[0] for s in shards] == ["req.abc.kv0-1", "req.abc.kv1-2"]
    # the job carries them to every rank
    job = PrefillJob("req", kv_key, [1, 2], SamplingParams(), "127.0.0.1:1", 0, shards=shards)
    assert PrefillJob.from_tensor(job.to_tensor()) == job


def test_every_holder_of_a_replicated_kv_head_loads_its_prefix_from_the_first_holders_shard() -> None:
    shards = replica_shards("req.abc/" + "f" * 16, "f" * 64, TINY, 4)  # heads 0, 1 stored by ranks 0, 2
    holders = [shard_holding(shards, TensorParallelShard(r, 4).kv_head_range(TINY)) for r in range(4)]
    assert holders == [0, 0, 1, 1]
    assert shard_holding(replica_shards("req.abc/" + "f" * 16, "f" * 64, TINY, 1), range(0, 2)) == 0
    with pytest.raises(ValueError, match="heads 0-2"):
        shard_holding(shards, range(0, 2))  # a TP=1 rank's heads: no TP=4 shard holds them all


# 3 tokens: fewer than 2 x PCP, so one PCP rank's DualChunkSwap share is partly empty.
@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 300])
def test_tp2_pcp2_replica_shards_and_first_token_equal_single_rank_prefill(stack, reference, n) -> None:
    request_id = f"tp-replica-{n}"
    reply, shards = stack.run(prefill_and_fetch_shards(stack, request_id, prompt(n)))
    first, expected = single_rank(reference, prompt(n))
    assert reply.first_token_id == first
    kv = reply.kv
    assert (kv.source_tp_size, kv.source_pcp_rank) == (TP, replica_owner(request_id, PCP))
    assert kv.fingerprint == reference.layout.fingerprint()
    # one shard per K/V head range, covering every head once, in order, each under its own fingerprint
    assert [(s.kv_head_start, s.kv_head_end) for s in kv.shards] == [(0, 1), (1, 2)]
    assert [s.fingerprint for s in kv.shards] == [
        shard_fingerprint(kv.fingerprint, range(h, h + 1), 2) for h in (0, 1)
    ]
    assert len({s.key for s in kv.shards}) == 2 and kv.key == kv.shards[0].key
    assert kv.total_bytes == sum(s.total_bytes for s in kv.shards) == expected.numel() * 4
    placed = torch.cat(shards, dim=3)
    assert placed.shape == expected.shape
    assert (placed - expected).abs().max().item() <= 1e-4
    assert stack.run(pinned_bytes(kv.store_address)) == 0


@pytest.mark.slow
def test_tp2_pcp2_a_prompt_extending_a_stored_one_loads_each_heads_prefix_and_its_kv_stays_exact(
    stack, reference
) -> None:
    ids = torch.randint(0, 256, (260,), generator=torch.Generator().manual_seed(23)).tolist()

    async def turns():
        client = PrefillClient(prefill_address(stack))
        try:
            # Each of its two shards (one K/V head each) offers 12 full prefix blocks of 16 (192 tokens).
            first = await client.prefill("tp-turn-1", ids[:200], GREEDY, timeout=60)
            second = await client.prefill("tp-turn-2", ids, GREEDY, timeout=60)
        finally:
            await client.close()
        kv, layout = second.kv, second.kv.layout
        by_head: dict[int, list[torch.Tensor]] = {}  # each head range's pieces, in token order
        async with KvStoreClient(kv.store_address) as store:
            for shard in first.kv.shards:
                await store.release(shard.key, shard.capability)
            # Decode's read: each head range's prefix segments through the one lease, then its new shard.
            for segment in kv.prefix_segments:
                heads = segment.kv_head_end - segment.kv_head_start
                row = heads * layout.head_dim * 4
                selection = segment_range(
                    segment.object_bytes, layout.num_layers * 2, row, segment.token_start, segment.token_count
                )
                data, _ = await store.get(
                    segment.key,
                    segment.fingerprint,
                    kv.prefix_lease_capability,
                    ranges=[selection],
                    lease_id=kv.prefix_lease_id,
                )
                shape = (layout.num_layers, 2, segment.token_count, heads, layout.head_dim)
                by_head.setdefault(segment.kv_head_start, []).append(
                    torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
                )
            for shard in kv.shards:
                data, _ = await store.get(shard.key, shard.fingerprint, shard.capability)
                await store.release(shard.key, shard.capability)
                shape = (layout.num_layers, 2, kv.num_tokens - kv.cached_tokens, 1, layout.head_dim)
                by_head[shard.kv_head_start].append(
                    torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
                )
            assert await store.release(kv.prefix_lease_id, kv.prefix_lease_capability, lease=True)
        whole = torch.cat([torch.cat(by_head[h], dim=2) for h in sorted(by_head)], dim=3)
        return second, whole

    second, whole = stack.run(turns())
    kv = second.kv
    assert (kv.cached_tokens, second.computed_tokens) == (192, 68)
    # every head range's prefix, read under that shard's own fingerprint
    assert sorted({(s.kv_head_start, s.kv_head_end, s.fingerprint) for s in kv.prefix_segments}) == [
        (h, h + 1, shard_fingerprint(kv.fingerprint, range(h, h + 1), 2)) for h in (0, 1)
    ]
    first_token, expected = single_rank(reference, ids)
    assert second.first_token_id == first_token
    assert whole.shape == expected.shape
    assert (whole - expected).abs().max().item() <= 1e-4
    assert stack.run(pinned_bytes(kv.store_address)) == 0
