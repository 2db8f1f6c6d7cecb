"""The client side of a transfer: copies with their CRC32C, the mappings a client keeps of the store's
segments (reused from one transfer to the next, dropped once the store unlinks a segment), and the buffers
its gets land in (reused once their reader lets go)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pcpstack.kvstore.checksum import crc32c
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.shm import ReceiveBuffers, SegmentMaps, SegmentStore, copy_with_crc


@pytest.mark.parametrize(
    "sizes",
    [[0], [5], [1 << 20, 3], [(9 << 20) + 1, 7, (8 << 20) - 3], [(17 << 20) + 5], [1, (40 << 20) + 11]],
    ids=["empty", "small", "two-pieces", "cut-inside-a-piece", "two-threads", "cut-in-the-last-piece"],
)
@pytest.mark.parametrize("crc_of_copy", [False, True], ids=["crc-of-source", "crc-of-copy"])
def test_copy_with_crc_copies_every_byte_in_order_and_returns_their_crc(sizes, crc_of_copy):
    pieces = [random.randbytes(size) for size in sizes]
    whole = b"".join(pieces)
    out = bytearray(len(whole) + 3)  # the copy stops where the pieces end
    crc = copy_with_crc(memoryview(out), [memoryview(p) for p in pieces], crc_of_copy=crc_of_copy)
    assert bytes(out[: len(whole)]) == whole and out[len(whole) :] == b"\0\0\0"
    assert crc == crc32c(whole)


@pytest.fixture
def segments(tmp_path):
    store = SegmentStore(tmp_path)
    yield store
    store.close()


def test_maps_are_kept_and_a_later_transfer_reads_what_an_earlier_one_wrote(segments):
    maps = SegmentMaps(str(segments.directory))
    first, second = segments.allocate(3 << 20), segments.allocate(1 << 20)
    payload = random.randbytes(3 << 20)
    assert maps.fill(first.name, [memoryview(payload[:5]), memoryview(payload[5:])]) == crc32c(payload)
    assert maps.fill(second.name, memoryview(payload[: 1 << 20])) == crc32c(payload[: 1 << 20])
    with first.view(0, 3 << 20) as stored:
        assert stored == payload  # through the store's own mapping
    data = bytearray(3 << 20)
    assert maps.copy_out(first.name, memoryview(data)) == crc32c(payload) and data == payload
    assert maps.mapped == [second.name, first.name]  # least recently used first
    maps.close()
    assert maps.mapped == []


def test_a_segment_the_store_unlinked_is_unmapped_at_the_next_transfer(segments):
    maps = SegmentMaps(str(segments.directory))
    gone, kept = segments.allocate(1 << 20), segments.allocate(1 << 20)
    maps.fill(gone.name, memoryview(bytes(1 << 20)))
    gone.destroy()
    assert maps.mapped == [gone.name]
    maps.fill(kept.name, memoryview(bytes(1 << 20)))
    assert maps.mapped == [kept.name]


def test_at_most_max_mapped_segments_stay_mapped(segments):
    maps = SegmentMaps(str(segments.directory), max_mapped=2)
    names = [segments.allocate(4096).name for _ in range(3)]
    for name in names:
        maps.fill(name, memoryview(bytes(4096)))
    assert maps.mapped == names[1:]
    with pytest.raises(ValueError, match="max_mapped must be >= 1"):
        SegmentMaps(str(segments.directory), max_mapped=0)


def test_a_segment_the_store_grew_is_mapped_again_at_its_new_size(segments):
    maps = SegmentMaps(str(segments.directory))
    segment = segments.allocate(4096)
    maps.fill(segment.name, memoryview(bytes(4096)))
    segments.recycle(segment)
    grown = segments.allocate(3 << 20)
    assert grown is segment  # the pooled segment, resized
    payload = random.randbytes(3 << 20)
    assert maps.fill(grown.name, memoryview(payload)) == crc32c(payload)
    with grown.view(0, 3 << 20) as stored:
        assert stored == payload


def test_pool_reuses_a_segment_at_most_a_quarter_larger_as_it_is_and_resizes_others(segments):
    segment = segments.allocate(4 << 20)
    segments.recycle(segment)
    reused = segments.allocate(13 << 18)  # 3.25 MiB: the 4 MiB segment is at most a quarter larger
    assert reused is segment and reused.size == reused.path.stat().st_size == 4 << 20
    maps = SegmentMaps(str(segments.directory))
    payload = random.randbytes(13 << 18)
    assert maps.fill(reused.name, memoryview(payload)) == crc32c(payload)
    with reused.view(0, len(payload)) as stored:
        assert stored == payload
    segments.recycle(reused)
    shrunk = segments.allocate(1 << 20)  # 4x the object: its tail goes back to the system
    assert shrunk is segment and shrunk.size == shrunk.path.stat().st_size == 1 << 20
    segments.recycle(shrunk)
    grown = segments.allocate(2 << 20)
    assert grown is segment and grown.size == grown.path.stat().st_size == 2 << 20
    payload = random.randbytes(2 << 20)
    assert maps.fill(grown.name, memoryview(payload)) == crc32c(payload)
    with grown.view(0, 2 << 20) as stored:
        assert stored == payload
    segments.recycle(grown)
    assert segments.pooled_bytes == 2 << 20
    maps.close()


def test_a_receive_buffer_is_reused_only_once_nothing_refers_to_it():
    buffers = ReceiveBuffers(max_pooled_bytes=64 << 20)
    first = buffers.take(8 << 20)
    first[:3] = b"abc"
    held = buffers.take(8 << 20)  # first is still referred to: a new buffer
    held[:3] = b"xyz"
    assert first[:3] == b"abc" and buffers.pooled_bytes == 16 << 20
    tensor = torch.frombuffer(held, dtype=torch.uint8)
    del first, held
    again = buffers.take(6 << 20)  # the first buffer, free now; the tensor still holds the second
    assert bytes(again[:3]) == b"abc" and len(again) == 6 << 20
    assert bytes(tensor[:3].numpy()) == b"xyz" and buffers.pooled_bytes == 16 << 20


def test_receive_buffers_hold_at_most_max_pooled_bytes():
    buffers = ReceiveBuffers(max_pooled_bytes=20 << 20)
    for _ in range(3):
        buffers.take(8 << 20)  # each dropped at once, so reused
    assert buffers.pooled_bytes == 8 << 20
    kept = [buffers.take(8 << 20) for _ in range(3)]  # three in use: the oldest is forgotten, not freed
    assert buffers.pooled_bytes == 16 << 20 and all(len(k) == 8 << 20 for k in kept)
    small, huge = buffers.take(4096), buffers.take(32 << 20)  # neither is pooled
    assert (len(small), len(huge), buffers.pooled_bytes) == (4096, 32 << 20, 16 << 20)
    assert ReceiveBuffers(0).take(8 << 20) is not None
    with pytest.raises(ValueError, match="max_pooled_bytes must be >= 0"):
        ReceiveBuffers(-1)


def test_a_client_refuses_a_negative_receive_pool_naming_it():
    async def body():
        with pytest.raises(ValueError, match="receive_pool_bytes must be >= 0"):
            KvStoreClient("127.0.0.1:1", receive_pool_bytes=-1)

    asyncio.run(body())
