"""The client side of a transfer: copies with their CRC32C, the mappings a client keeps of the store's
segments (reused from one transfer to the next, dropped once the store unlinks a segment), the standby
segments the store prepares for a writer's next put, and the buffers its gets land in (reused once their
reader lets go)."""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import threading
import time

import pytest
import torch

from pcpstack.kvstore import shm
from pcpstack.kvstore.checksum import crc32c
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.shm import (
    BACKGROUND_NICE,
    ReceiveBuffers,
    SegmentMaps,
    SegmentStore,
    copy_with_crc,
    lower_thread_priority,
    populate_writable,
)


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


def test_a_standby_waits_in_the_pool_until_prepared_then_goes_to_the_put_naming_it(segments):
    standby, new = segments.standby(4 << 20, budget=64 << 20)
    assert new and not standby.ready and standby.path.stat().st_size == 4 << 20  # named and sized at once
    # a writer's next put of that size keeps its standby; another writer gets one of its own
    assert segments.standby(4 << 20, budget=64 << 20, held=standby.name) == (standby, False)
    other = segments.allocate(4 << 20, preferred=standby.name)
    assert other is not standby  # a put never gets a segment still being prepared
    segments.trim(0)
    assert segments.pooled_bytes == 4 << 20  # nor does trim unlink it under its preparer's feet
    segments.prepare(standby)
    assert standby.ready
    segments.recycle(other)  # two ready segments that fit: the named one is taken
    assert segments.allocate(4 << 20, preferred=standby.name) is standby
    assert segments.allocate(4 << 20, preferred="../../etc/passwd") is other  # any other name: ignored
    segments.recycle(standby)
    assert segments.allocate(1 << 20, preferred=standby.name) is standby  # 4x too large: resized, not kept
    assert standby.size == 1 << 20


def test_a_writer_maps_a_standby_only_once_the_store_has_prepared_it(segments):
    """Two processes faulting the same fresh tmpfs pages at once each pay for them: the store holds a lock
    on a standby until its pages are in, and a writer mapping it ahead of its put waits for that."""
    standby, _ = segments.standby(4 << 20, budget=64 << 20)
    maps = SegmentMaps(str(segments.directory))
    prefetch = threading.Thread(target=maps.prefetch, args=(standby.name,))
    prefetch.start()
    prefetch.join(timeout=0.5)
    assert prefetch.is_alive() and maps.mapped == []  # still waiting for the store
    segments.prepare(standby)
    prefetch.join(timeout=10)
    assert not prefetch.is_alive() and maps.mapped == [standby.name]
    assert maps.fill(standby.name, memoryview(b"abcd")) == crc32c(b"abcd")
    with standby.view(0, 4) as data:  # the same pages as the store's
        assert bytes(data) == b"abcd"
    maps.close()


def test_a_writer_maps_a_standby_anyway_when_the_store_never_lets_go(segments, monkeypatch, caplog):
    """A store frozen while preparing cannot hold a writer's prefetch forever: past PREPARED_WAIT_S it maps
    the segment as it would have without waiting."""
    monkeypatch.setattr(shm, "PREPARED_WAIT_S", 0.2)
    standby, _ = segments.standby(4 << 20, budget=64 << 20)
    maps = SegmentMaps(str(segments.directory))
    started = time.monotonic()
    assert maps.prefetch(standby.name) and maps.mapped == [standby.name]
    assert time.monotonic() - started >= 0.2
    assert f"the store still prepares segment {standby.name}" in caplog.text
    maps.close()
    segments.prepare(standby)


def test_no_standby_beyond_the_budget_and_one_prepared_after_close_is_unlinked(tmp_path):
    segments = SegmentStore(tmp_path)
    assert segments.standby(4 << 20, budget=(4 << 20) - 1) == (None, False)
    standby, _ = segments.standby(4 << 20, budget=4 << 20)
    segments.close()
    segments.prepare(standby)
    assert not standby.path.exists()


def test_a_standby_takes_the_room_of_pooled_segments_promised_to_nobody_never_of_a_standby(segments):
    """Within its budget a new standby unlinks free segments no writer was promised (largest first),
    never another writer's standby; and trim unlinks those promised to nobody first."""
    other, _ = segments.standby(4 << 20, budget=64 << 20)  # another writer's
    segments.prepare(other)
    idle = [segments.allocate(size) for size in (1 << 20, 2 << 20, 8 << 20)]
    for seg in idle:
        segments.recycle(seg)  # deleted objects' segments: 15 MiB pooled beside the standby
    # 16 MiB more needs the 8 and the 2 MiB ones gone; the standby promised to the other writer stays.
    mine, new = segments.standby(16 << 20, budget=(4 + 1 + 16) << 20)
    assert new and segments.pooled_bytes == (4 + 1 + 16) << 20
    assert other.path.exists() and idle[0].path.exists()
    assert not idle[1].path.exists() and not idle[2].path.exists()
    # Too little room even with every idle segment gone: none is unlinked for nothing.
    assert segments.standby(8 << 20, budget=(4 + 16 + 7) << 20) == (None, False) and idle[0].path.exists()
    segments.prepare(mine)
    segments.trim(20 << 20)  # the idle 1 MiB first, and then enough
    assert not idle[0].path.exists() and other.path.exists() and mine.path.exists()
    segments.trim(16 << 20)  # then standbys, largest first
    assert not mine.path.exists() and other.path.exists()


def test_a_standby_whose_writer_went_away_is_promised_no_more_after_the_ttl(tmp_path):
    """A writer that never comes back (a restarted rank) must not keep its standby's room for good: after
    the TTL without a word from it, the segment is free for another writer; a writer that names its
    standby in time keeps it."""
    now = [0.0]
    segments = SegmentStore(tmp_path, promise_ttl_s=10.0, clock=lambda: now[0])
    try:
        gone, _ = segments.standby(4 << 20, budget=64 << 20)
        kept, _ = segments.standby(4 << 20, budget=64 << 20)
        for standby in (gone, kept):
            segments.prepare(standby)
        now[0] = 8.0
        assert segments.standby(4 << 20, budget=64 << 20, held=kept.name) == (kept, False)  # renewed
        assert segments.promised_bytes == 8 << 20
        now[0] = 12.0  # the first writer was last heard of at 0
        assert segments.promised_bytes == 8 << 20  # lapsing happens at the next standby or allocate
        newcomer, new = segments.standby(4 << 20, budget=8 << 20)
        assert newcomer is gone and not new and gone.promised and kept.promised
        assert segments.promised_bytes == 8 << 20
        now[0] = 30.0  # both lapse; the one named in a put is still taken by that put
        assert segments.allocate(4 << 20, preferred=kept.name) is kept and not gone.promised
    finally:
        segments.close()
    with pytest.raises(ValueError, match="promise_ttl_s must be > 0"):
        SegmentStore(tmp_path, promise_ttl_s=0)


def test_a_standby_that_cannot_be_prepared_is_dropped_from_the_pool(segments):
    standby, _ = segments.standby(4 << 20, budget=64 << 20)
    standby.size = 1 << 60  # more than any /dev/shm holds: fallocate fails as on a full tmpfs
    segments.prepare(standby)
    assert standby.failed and not standby.ready
    assert segments.allocate(1 << 20) is not standby
    assert segments.pooled_bytes == 0 and not standby.path.exists()


@pytest.mark.parametrize("size", [3 << 20, (20 << 20) + 5])  # one madvise call, and three (the last short)
def test_populate_writable_builds_the_mapping_without_changing_a_byte(tmp_path, size):
    payload = random.randbytes(size)
    path = tmp_path / "segment"
    path.write_bytes(payload)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), len(payload)) as map_:
        assert populate_writable(map_)  # Linux 5.14+
        assert map_[:] == payload
        map_[:5] = b"after"  # and it is still writable
        os.truncate(path, 1 << 20)  # as the store shrinks a segment a client has mapped
        assert not populate_writable(map_)  # refused: the tail is gone, and nothing touched it
    assert path.read_bytes() == b"after" + payload[5 : 1 << 20]


def test_background_work_lowers_the_priority_of_its_own_thread_only():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []

    def background() -> None:
        lower_thread_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    worker = threading.Thread(target=background)
    worker.start()
    worker.join()
    assert seen == [min(19, mine + BACKGROUND_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_a_prefetched_segment_is_kept_mapped_for_the_next_fill(segments):
    maps = SegmentMaps(str(segments.directory), max_mapped=2)
    standby, _ = segments.standby(2 << 20, budget=64 << 20)
    segments.prepare(standby)  # a prefetch waits for that (test_a_writer_maps_a_standby_only_once_...)
    assert maps.prefetch(standby.name) and maps.mapped == [standby.name]
    assert maps.prefetch(standby.name)  # mapped already: kept as it is
    payload = random.randbytes(2 << 20)
    assert maps.fill(standby.name, memoryview(payload)) == crc32c(payload)
    with standby.view(0, 2 << 20) as stored:
        assert stored == payload
    assert not maps.prefetch("pcpkv-missing-1") and maps.mapped == [standby.name]
    maps.close()
    assert not maps.prefetch(standby.name) and maps.mapped == []  # nothing is kept after close
    assert os.path.exists(standby.path)


def test_each_writer_keeps_a_standby_of_its_own(segments):
    """Two writers of objects of one size (the PCP ranks of a set take turns pushing): each gets a standby
    of its own, and only a put naming a standby takes it; trim still reclaims them."""
    first, new_first = segments.standby(4 << 20, budget=64 << 20)
    second, new_second = segments.standby(4 << 20, budget=64 << 20)
    assert new_first and new_second and first is not second
    for standby in (first, second):
        segments.prepare(standby)
    assert segments.standby(4 << 20, budget=64 << 20, held=first.name) == (first, False)
    assert segments.allocate(4 << 20, preferred=second.name) is second
    unnamed = segments.allocate(4 << 20)
    assert unnamed is not first  # promised to the first writer: a put that does not name it makes its own
    segments.recycle(unnamed)
    # The first writer moves on to objects of another size: its old standby is promised no more.
    bigger, _ = segments.standby(16 << 20, budget=64 << 20, held=first.name)
    assert bigger is not first and bigger.promised and not first.promised
    segments.trim(0)  # the standbys are free segments: the budget reclaims them (not one being prepared)
    assert not first.path.exists() and segments.pooled_bytes == 16 << 20


def test_a_standby_shrinks_a_larger_free_segment_where_the_pool_has_no_room_for_a_new_one(segments):
    """In a full store the free segments are what evictions left, and the pool has no room for a new
    standby beside them: the smallest larger one promised to nobody becomes the standby, shrunk to size,
    its pages warm (a new segment's would all be allocated during the announcing writer's forward, after
    unlinking free ones for its room). Another writer's standby is never taken; with room to spare a new
    one is made and the larger free one stays as it is."""
    theirs, _ = segments.standby(32 << 20, budget=128 << 20)  # another writer's
    segments.prepare(theirs)
    idle = [segments.allocate(size) for size in (12 << 20, 24 << 20)]
    for seg in idle:
        segments.recycle(seg)  # 68 MiB pooled
    standby, new = segments.standby(4 << 20, budget=70 << 20)
    assert standby is idle[0] and not new and standby.promised and standby.ready
    assert standby.size == os.path.getsize(standby.path) == 4 << 20
    assert segments.pooled_bytes == (32 + 4 + 24) << 20 and theirs.size == 32 << 20
    assert segments.allocate(4 << 20, preferred=standby.name) is standby  # its writer's put takes it
    payload = random.randbytes(4 << 20)
    standby.write(0, payload)
    with standby.view(0, 4 << 20) as stored:
        assert stored == payload
    segments.recycle(standby)  # 60 MiB pooled, the 4 MiB one free again
    roomy, new = segments.standby(16 << 20, budget=128 << 20)
    assert new and roomy not in idle and idle[1].size == 24 << 20
    segments.prepare(roomy)
    tight, new = segments.standby(16 << 20, budget=80 << 20)  # 76 MiB pooled: no room for 16 more
    assert tight is idle[1] and not new and tight.size == 16 << 20
    assert segments.pooled_bytes == (32 + 4 + 16 + 16) << 20
