"""Paged KV cache: block allocation, slot arithmetic, layout fingerprints and replica export/import."""

import itertools
import subprocess
import sys

import pytest
import torch

from pcpstack.engine.kv_cache import BlockAllocator, KvLayout, OutOfBlocksError, PagedKVCache, slots_for

LAYOUT = KvLayout("model-a", num_layers=2, num_kv_heads=3, head_dim=4, dtype="float32", block_size=4)


def test_allocator_refuses_when_out_of_blocks_without_taking_any():
    allocator = BlockAllocator(3)
    allocator.allocate(2)
    with pytest.raises(OutOfBlocksError, match="need 2, 1 free of 3"):
        allocator.allocate(2)
    assert allocator.num_free == 1


def test_allocator_refuses_double_free():
    allocator = BlockAllocator(2)
    blocks = allocator.allocate(1)
    allocator.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(blocks)


def test_slots_follow_block_table():
    slots = slots_for([5, 2], torch.arange(8), block_size=4)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11]


def test_slots_beyond_block_table_are_refused():
    with pytest.raises(ValueError, match="beyond the block table"):
        slots_for([0], torch.tensor([4]), block_size=4)


def test_fingerprint_is_stable_across_processes():
    code = (
        "from pcpstack.engine.kv_cache import KvLayout;"
        "print(KvLayout('model-a', 2, 3, 4, 'float32', 4).fingerprint())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == LAYOUT.fingerprint()


@pytest.mark.parametrize(
    "change", [{"model_id": "model-b"}, {"dtype": "bfloat16"}, {"block_size": 8}, {"num_kv_heads": 1}]
)
def test_fingerprint_changes_with_each_layout_field(change):
    fields = {**LAYOUT.__dict__, **change}
    assert KvLayout(**fields).fingerprint() != LAYOUT.fingerprint()


def test_export_then_import_into_other_blocks_round_trips():
    source, target = PagedKVCache(LAYOUT, 8), PagedKVCache(LAYOUT, 8)
    source.data.copy_(torch.randn_like(source.data))
    replica = source.export_sequence([3, 1, 6], num_tokens=10)
    assert replica.shape == (2, 2, 10, 3, 4) and replica.is_contiguous()
    target.import_sequence(replica, [0, 7, 2])
    torch.testing.assert_close(target.export_sequence([0, 7, 2], 10), replica, rtol=0, atol=0)
    torch.testing.assert_close(target.data[:, :, 7], source.data[:, :, 1], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("table", "num_tokens", "runs"),
    [([3, 1, 6], 10, 3), ([2, 3, 4, 0, 1], 18, 2), ([5, 6, 7], 12, 1), ([0, 1, 2, 3, 4, 5, 6, 7], 29, 1)],
)
@pytest.mark.parametrize("start", [0, 3, 4, 9])
def test_sequence_pieces_hold_the_exported_bytes_in_order_without_a_copy(table, num_tokens, runs, start):
    cache = PagedKVCache(LAYOUT, 8)
    cache.data.copy_(torch.randn_like(cache.data))
    pieces = cache.sequence_pieces(table, num_tokens=num_tokens, start=start)
    assert all(p.is_contiguous() and p.untyped_storage().data_ptr() == cache.data.data_ptr() for p in pieces)
    joined = torch.cat([p.reshape(-1) for p in pieces])
    assert torch.equal(joined, cache.export_sequence(table, num_tokens=num_tokens)[:, :, start:].reshape(-1))
    # consecutive block ids are one piece per layer and K/V (blocks before `start` are not visited)
    skipped = start // LAYOUT.block_size
    visited = table[skipped : -(-num_tokens // LAYOUT.block_size)]
    expected_runs = 1 + sum(b != a + 1 for a, b in itertools.pairwise(visited))
    assert expected_runs == runs or start >= LAYOUT.block_size  # the declared count, from block 0
    assert len(pieces) == LAYOUT.num_layers * 2 * expected_runs


def test_import_refuses_replica_of_another_shape():
    cache = PagedKVCache(LAYOUT, 4)
    with pytest.raises(ValueError, match="expects"):
        cache.import_sequence(torch.zeros(2, 2, 5, 1, 4), [0, 1])
