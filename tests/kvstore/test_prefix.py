"""Prefix reuse in the KV store: content-addressed block keys, the block index, prefix leases (refcounts and
pins), dedup, LRU eviction of unreferenced objects and salts; the core directly, then Lookup and a read
through a lease over real gRPC."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.errors import CapabilityDenied, CapacityExceeded, NotFound
from pcpstack.kvstore.prefix import prefix_block_keys, reusable_blocks, segment_range
from pcpstack.kvstore.store import KvStore, StoreConfig, held_bytes
from tests.kvstore.conftest import running_store

BLOCK = 4
SYSTEM = list(range(100, 100 + 3 * BLOCK))  # three full blocks of shared system prompt


def put_blocks(store: KvStore, key: str, keys: list[str], size: int = 10, now: float = 0.0) -> str:
    """Puts and commits an object holding the blocks `keys`; returns its capability."""
    pending = store.begin_put(key, "fp", size, 0, b"", block_keys=keys, block_tokens=BLOCK)
    pending.payload = f"payload-{key}"
    return store.commit_put(pending, 0, now).capability


def test_block_keys_chain_the_prefix_and_separate_fingerprints_and_salts():
    keys = prefix_block_keys([*SYSTEM, 1, 2], BLOCK, "fp")
    assert len(keys) == 3  # the partial last block has no key
    # A block's key names everything before it: the same tokens after another first block differ.
    other = prefix_block_keys([7] * BLOCK + SYSTEM[BLOCK:], BLOCK, "fp")
    assert keys[0] != other[0] and keys[1:] != other[1:]
    assert prefix_block_keys(SYSTEM, BLOCK, "fp") == keys
    assert set(prefix_block_keys(SYSTEM, BLOCK, "fp", salt="tenant-a")).isdisjoint(keys)
    assert set(prefix_block_keys(SYSTEM, BLOCK, "other-fp")).isdisjoint(keys)
    assert reusable_blocks(3 * BLOCK, BLOCK) == 2  # the last token always stays to compute
    assert reusable_blocks(3 * BLOCK + 1, BLOCK) == 3


def test_shared_blocks_are_refcounted_by_leases_and_evicted_lru_once_unreferenced():
    keys = prefix_block_keys(SYSTEM, BLOCK, "fp")
    # Room for turn-1 (its 10 bytes and its block keys) and 20 bytes more: "big" needs turn-1 evicted.
    store = KvStore(StoreConfig(capacity_bytes=held_bytes(10, b"", keys) + 20, default_lease_ms=1000))
    cap = put_blocks(store, "turn-1", keys)
    store.release("turn-1", cap)  # decode loaded it: cached, evictable unless referenced
    first = store.lookup(keys, "fp", 0, now=0.0)
    second = store.lookup([*keys, "unknown"], "fp", 0, now=0.0)
    assert (first.blocks, second.blocks, first.tokens) == (3, 3, 3 * BLOCK)
    assert [(s.obj.key, s.token_start, s.token_count) for s in first.segments] == [("turn-1", 0, 12)]
    assert store.find("turn-1").lease_refs == 2
    # Pinned by two leases: a put that needs its bytes is refused rather than evicting it.
    with pytest.raises(CapacityExceeded):
        store.begin_put("big", "fp", 25, 0, b"")
    store.release_lease(first.lease.lease_id, first.lease.capability)
    assert store.find("turn-1").lease_refs == 1
    store.expire(now=2.0)  # the second lease ran out without a release
    assert store.find("turn-1").lease_refs == 0
    store.begin_put("big", "fp", 25, 0, b"")  # now evicted under pressure, with its blocks
    stats = store.stats()
    assert (stats.evictions, stats.prefix_blocks, stats.prefix_lease_expiries) == (1, 0, 1)
    assert store.lookup(keys, "fp", 0, now=2.0).blocks == 0
    assert (stats.prefix_lookups, stats.prefix_blocks_queried, stats.prefix_blocks_hit) == (2, 7, 6)


def test_a_second_put_of_held_blocks_is_not_an_error_and_lookups_follow_the_runs():
    store = KvStore(StoreConfig(capacity_bytes=1 << 20))
    keys = prefix_block_keys(SYSTEM + list(range(2 * BLOCK)), BLOCK, "fp")
    put_blocks(store, "turn-1", keys[:3])
    put_blocks(store, "same-prompt", keys[:3])  # dedup: the first holder keeps serving them
    put_blocks(store, "turn-2", keys[3:])  # holds only the new blocks after the prefix
    found = store.lookup(keys, "fp", 0, now=0.0)
    assert found.blocks == 5
    assert [(s.obj.key, s.token_start, s.token_count) for s in found.segments] == [
        ("turn-1", 0, 3 * BLOCK),
        ("turn-2", 0, 2 * BLOCK),
    ]
    assert store.stats().prefix_blocks == 5
    assert store.lookup(keys, "another-fingerprint", 0, now=0.0).blocks == 0


def test_a_deleted_object_stays_readable_through_its_lease_until_it_ends():
    store = KvStore(StoreConfig(capacity_bytes=1 << 20))
    keys = prefix_block_keys(SYSTEM, BLOCK, "fp")
    cap = put_blocks(store, "turn-1", keys)
    lease = store.lookup(keys, "fp", 0, now=0.0).lease
    store.delete("turn-1", cap)
    assert store.lookup(keys, "fp", 0, now=0.0).blocks == 0  # gone from the index at once
    obj = store.begin_get("turn-1", "fp", lease.capability, lease_id=lease.lease_id)
    store.end_get(obj, 0)
    with pytest.raises(CapabilityDenied):
        store.begin_get("turn-1", "fp", "wrong", lease_id=lease.lease_id)
    assert store.release_lease(lease.lease_id, lease.capability)
    assert store.stats().bytes == 0  # freed with the lease's last reference
    assert not store.release_lease(lease.lease_id, lease.capability)  # a repeat is harmless


def test_a_block_one_shards_chain_lacks_shortens_the_hit_of_every_shard_under_one_lease():
    # A replica stored per K/V head range (a TP group's): each shard's chain starts from its own fingerprint.
    store = KvStore(StoreConfig(capacity_bytes=1 << 20))
    prompt = SYSTEM + list(range(2 * BLOCK))  # five full blocks
    chains = [(fp, prefix_block_keys(prompt, BLOCK, fp)) for fp in ("fp-heads-0-1", "fp-heads-1-2")]
    assert set(chains[0][1]).isdisjoint(chains[1][1])
    for shard, (fp, keys) in enumerate(chains):
        # turn 1 stored the first three blocks of both shards; turn 2 added two, but shard 1's only one
        added = keys[3:] if shard == 0 else keys[3:4]
        for name, held in ((f"turn-1.s{shard}", keys[:3]), (f"turn-2.s{shard}", added)):
            pending = store.begin_put(name, fp, 10, 0, b"", block_keys=held, block_tokens=BLOCK)
            pending.payload = name
            store.commit_put(pending, 0, 0.0)
    found = store.lookup_chains(chains, 0, now=0.0)
    assert (found.blocks, found.tokens) == (4, 4 * BLOCK)  # shard 0 holds 5: the run both hold is 4
    assert [(s.chain, s.obj.key, s.token_start, s.token_count) for s in found.segments] == [
        (0, "turn-1.s0", 0, 3 * BLOCK),
        (0, "turn-2.s0", 0, BLOCK),
        (1, "turn-1.s1", 0, 3 * BLOCK),
        (1, "turn-2.s1", 0, BLOCK),
    ]
    assert set(found.lease.objects) == {"turn-1.s0", "turn-2.s0", "turn-1.s1", "turn-2.s1"}
    assert all(store.find(key).lease_refs == 1 for key in found.lease.objects)
    # A shard missing the first block is a miss for all: no lease, no reference taken.
    missing = store.lookup_chains([chains[0], ("fp-heads-1-2", ["unknown", *chains[1][1][1:]])], 0, now=0.0)
    assert (missing.blocks, missing.lease) == (0, None)
    assert store.find("turn-1.s0").lease_refs == 1


@pytest.mark.timeout(60)
def test_lookup_and_a_ranged_read_through_the_lease_over_grpc():
    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            keys = prefix_block_keys(SYSTEM, BLOCK, "fp", salt="tenant-a")
            kv = np.arange(2 * 3 * BLOCK, dtype=np.float32)  # 2 planes of 12 one-float tokens
            stored = await client.put("turn-1", "fp", kv, block_keys=keys, block_tokens=BLOCK)
            assert (await client.lookup(prefix_block_keys(SYSTEM, BLOCK, "fp"), "fp")).blocks == 0
            found = await client.lookup(keys[:2], "fp")
            assert (found.blocks, found.tokens) == (2, 2 * BLOCK)
            segment = found.segments[0]
            ranges = [segment_range(segment.object_bytes, 2, 4, segment.token_start, segment.token_count)]
            data, _ = await client.get(
                segment.key, "fp", found.capability, ranges=ranges, lease_id=found.lease_id
            )
            expected = np.concatenate([kv[: 2 * BLOCK], kv[3 * BLOCK : 5 * BLOCK]])
            assert np.array_equal(np.frombuffer(data, dtype=np.float32), expected)
            with pytest.raises(CapabilityDenied):  # the lease's capability is not the object's
                await client.release("turn-1", found.capability)
            assert await client.release(found.lease_id, found.capability, lease=True)
            with pytest.raises(NotFound):
                await client.get(segment.key, "fp", found.capability, lease_id=found.lease_id)
            stat = await client.stat()
            assert (stat.prefix_blocks, stat.prefix_blocks_hit, stat.prefix_leases) == (3, 2, 0)
            assert stat.prefix_bytes == stored.total_bytes

    asyncio.run(body())
