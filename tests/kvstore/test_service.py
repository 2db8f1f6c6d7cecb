"""The KV store over real gRPC: round trips on both paths, integrity, refusals, capabilities, leases,
eviction and concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import threading
import time

import grpc
import pytest

from pcpstack.common.ports import free_port
from pcpstack.kvstore.client import ByteRange, KvStoreClient, make_key
from pcpstack.kvstore.errors import (
    AlreadyExists,
    CapabilityDenied,
    CapacityExceeded,
    ChecksumMismatch,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
)
from pcpstack.kvstore.server import KvStoreServerConfig
from pcpstack.kvstore.shm import BACKGROUND_NICE, SegmentMaps
from pcpstack.kvstore.store import DEFAULT_MAX_LEASE_MS
from pcpstack.prefill.server import LeaseBounds
from pcpstack.v1 import kvstore_pb2 as pb
from pcpstack.v1 import kvstore_pb2_grpc
from tests.kvstore.conftest import running_store, segment_files

CHUNK = 64 << 10
PATHS = pytest.mark.parametrize("prefer_shm", [False, True], ids=["grpc", "shm"])


@PATHS
@pytest.mark.timeout(60)
def test_round_trip_of_many_sizes(prefer_shm: bool):
    async def body():
        async with (
            running_store() as server,
            KvStoreClient(server.address, prefer_shm=prefer_shm, chunk_bytes=CHUNK) as client,
        ):
            assert await client.uses_shm() is prefer_shm
            for size in (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 5 << 20):
                payload = random.randbytes(size)
                key = make_key(f"req-{size}", "f" * 40)
                committed = await client.put(key, "fp", payload, metadata=b'{"layers": 2}')
                assert committed.total_bytes == size
                data, metadata = await client.get(key, "fp", committed.capability)
                assert bytes(data) == payload and metadata == b'{"layers": 2}'
            assert segment_files(server)  # committed objects live in segments whichever path wrote them

    asyncio.run(body())


@PATHS
@pytest.mark.timeout(60)
def test_an_object_put_in_pieces_is_their_bytes_one_after_another(prefer_shm: bool):
    async def body():
        async with (
            running_store() as server,
            KvStoreClient(server.address, prefer_shm=prefer_shm, chunk_bytes=CHUNK) as client,
        ):
            # pieces of odd sizes, one empty, one larger than a chunk and than the writer's 1 MiB step
            pieces = [random.randbytes(size) for size in (7, 0, CHUNK + 3, (1 << 20) + 5, 1)]
            committed = await client.put("pieces", "fp", [memoryview(p) for p in pieces])
            assert committed.total_bytes == sum(map(len, pieces))
            data, _ = await client.get("pieces", "fp", committed.capability)  # checked against the CRC
            assert bytes(data) == b"".join(pieces)
            alone = await client.put("alone", "fp", [memoryview(pieces[2])])  # a one-piece list
            assert bytes((await client.get("alone", "fp", alone.capability))[0]) == pieces[2]

    asyncio.run(body())


@PATHS
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_round_trip_of_100_mb(prefer_shm: bool):
    async def body():
        async with running_store() as server, KvStoreClient(server.address, prefer_shm=prefer_shm) as client:
            payload = os.urandom(100 * 1000 * 1000)
            committed = await client.put("big", "fp", memoryview(payload))
            data, _ = await client.get("big", "fp", committed.capability)
            assert data == payload
            assert (await client.stat()).bytes_out == len(payload)

    asyncio.run(body())


def test_tensor_bytes_round_trip_without_copy_on_read():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")

    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            kv = torch.randn(4, 8, 16, dtype=torch.float32)
            committed = await client.put("t", "fp", kv.numpy())
            data, _ = await client.get("t", "fp", committed.capability)
            back = torch.frombuffer(data, dtype=torch.float32).view(4, 8, 16)
            assert torch.equal(back, kv)
            assert np.shares_memory(np.frombuffer(data, dtype=np.uint8), back.numpy())

    asyncio.run(body())


async def _raw_put(
    address: str, messages: list[pb.PutRequest]
) -> grpc.aio.AioRpcError | list[pb.PutResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = kvstore_pb2_grpc.KvStoreServiceStub(channel).Put(iter(messages), timeout=10)
        try:
            return [message async for message in call]
        except grpc.aio.AioRpcError as exc:
            return exc


async def _settled(server, done, timeout: float = 5.0):
    """The store's stats once `done(stats)` holds (or at the timeout): the client sees the error status a
    moment before the handler's cleanup has run."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not done(stats := server.servicer.store.stats()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return stats


def _header(total: int, chunk: int = 4) -> pb.PutRequest:
    return pb.PutRequest(header=pb.PutHeader(key="k", fingerprint="fp", total_bytes=total, chunk_size=chunk))


def _chunk(offset: int, data: bytes, crc: int | None = None) -> pb.PutRequest:
    from pcpstack.kvstore.checksum import crc32c

    return pb.PutRequest(
        chunk=pb.PutChunk(offset=offset, data=data, crc32c=crc32c(data) if crc is None else crc)
    )


def test_corrupted_chunk_is_rejected_and_leaves_nothing():
    async def body():
        async with running_store() as server:
            error = await _raw_put(
                server.address, [_header(8), _chunk(0, b"abcd"), _chunk(4, b"efgh", crc=123)]
            )
            assert error.code() == grpc.StatusCode.DATA_LOSS and "offset 4" in error.details()
            stats = await _settled(
                server, lambda s: (s.objects, s.reserved_bytes, s.refused_puts) == (0, 0, 1)
            )
            assert (stats.objects, stats.reserved_bytes, stats.refused_puts) == (0, 0, 1)

    asyncio.run(body())


async def _shm_put_with_a_flipped_byte(server, channel, size: int, offset: int, mask: int) -> str:
    """An shm put of `size` random bytes whose segment, once filled, has the byte at `offset` XORed with
    `mask` before the commit carries the fill's CRC; asserts the store refuses it (DATA_LOSS). Returns the
    segment's name."""
    payload = random.randbytes(size)
    call = kvstore_pb2_grpc.KvStoreServiceStub(channel).Put(timeout=10)
    header = pb.PutHeader(key="k", fingerprint="fp", total_bytes=size, use_shm=True)
    await call.write(pb.PutRequest(header=header))
    name = (await call.read()).accepted.shm_name
    shm_dir = str(server.servicer.segments.directory)
    maps = SegmentMaps(shm_dir)
    crc = maps.fill(name, memoryview(payload))
    maps.close()
    with open(os.path.join(shm_dir, name), "r+b") as segment:
        segment.seek(offset)
        segment.write(bytes([payload[offset] ^ mask]))
    await call.write(pb.PutRequest(commit=pb.PutCommit(crc32c=crc)))
    with contextlib.suppress(grpc.aio.AioRpcError):
        await call.read()
    assert await call.code() == grpc.StatusCode.DATA_LOSS and "commit says" in await call.details()
    return name


def test_shm_put_whose_segment_differs_from_its_commit_is_rejected_and_leaves_nothing():
    async def body():
        async with running_store() as server, grpc.aio.insecure_channel(server.address) as channel:
            size = (32 << 20) + 5  # large enough for the store to verify on two threads
            # One bit flips in the second half.
            await _shm_put_with_a_flipped_byte(server, channel, size, offset=size - 7, mask=1)
            stats = await _settled(
                server, lambda s: (s.objects, s.reserved_bytes, s.refused_puts) == (0, 0, 1)
            )
            assert (stats.objects, stats.reserved_bytes, stats.refused_puts) == (0, 0, 1)
            assert server.servicer.segments.pooled_bytes == size  # the segment went back to the pool

    asyncio.run(body())


@pytest.mark.parametrize(
    ("messages", "detail"),
    [
        ([_chunk(0, b"abcd")], "first message of a Put must be a header"),
        ([_header(8), _chunk(4, b"abcd")], "offset 4"),
        ([_header(8), _chunk(0, b"abc")], "expected 4"),
        ([_header(8), _chunk(0, b"abcd"), pb.PutRequest(commit=pb.PutCommit())], "total_bytes=8"),
        ([_header(8), _chunk(0, b"abcd")], "ended before its commit"),
        ([_header(8, chunk=0)], "chunk_size"),
    ],
    ids=["no-header", "offset", "short-chunk", "short-total", "no-commit", "chunk-size"],
)
def test_malformed_put_is_invalid_argument_naming_the_problem(messages, detail):
    async def body():
        async with running_store() as server:
            error = await _raw_put(server.address, messages)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in error.details()
            stats = await _settled(server, lambda s: (s.objects, s.reserved_bytes) == (0, 0))
            assert (stats.objects, stats.reserved_bytes) == (0, 0)

    asyncio.run(body())


@PATHS
def test_reader_detects_corrupted_bytes(prefer_shm: bool):
    async def body():
        async with running_store() as server, KvStoreClient(server.address, prefer_shm=prefer_shm) as client:
            committed = await client.put("k", "fp", b"x" * 10_000)
            server.servicer.store.find("k").payload.write(5_000, b"y")  # bit rot inside the store
            with pytest.raises(ChecksumMismatch, match="CRC32C"):
                await client.get("k", "fp", committed.capability)

    asyncio.run(body())


def test_refusals_carry_their_status_codes():
    async def body():
        async with running_store(capacity_bytes=1000) as server, KvStoreClient(server.address) as client:
            committed = await client.put("k", "fp", b"abc")
            with pytest.raises(AlreadyExists):
                await client.put("k", "fp", b"abc")
            with pytest.raises(FingerprintMismatch):
                await client.get("k", "other-model", committed.capability)
            with pytest.raises(NotFound):
                await client.get("missing", "fp", committed.capability)
            with pytest.raises(NotFound):
                await client.release("missing", committed.capability)
            with pytest.raises(CapacityExceeded, match="needs 2000 bytes"):
                await client.put("huge", "fp", bytes(2000))
            assert await client.delete("missing", "") is False
            stats = await client.stat()
            assert (stats.objects, stats.reserved_bytes, stats.refused_puts) == (1, 0, 2)

    asyncio.run(body())


def test_release_is_counted_once_and_repeats_are_reported():
    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            capability = (await client.put("k", "fp", b"abc")).capability
            assert (await client.stat("k", capability)).object.pinned
            assert await client.release("k", capability) is True
            assert await client.release("k", capability) is False
            stats = await client.stat("k", capability)
            assert (stats.object.pinned, stats.pinned_bytes, stats.repeated_releases) == (False, 0, 1)

    asyncio.run(body())


@pytest.mark.timeout(30)
def test_lease_expiry_reclaims_the_object():
    async def body():
        async with running_store(reap_interval_s=0.05) as server, KvStoreClient(server.address) as client:
            short = await client.put("k", "fp", b"x" * 1000, lease_ms=100)
            await client.put("kept", "fp", b"x" * 1000, lease_ms=60_000)
            for _ in range(100):
                if (await client.stat()).lease_expiries:
                    break
                await asyncio.sleep(0.05)
            stats = await client.stat()
            assert (stats.lease_expiries, stats.objects, stats.bytes) == (1, 1, 1000)
            with pytest.raises(NotFound):
                await client.get("k", "fp", short.capability)

    asyncio.run(body())


def test_eviction_under_pressure_is_lru_among_released_and_spares_pinned():
    async def body():
        async with running_store(capacity_bytes=4000) as server, KvStoreClient(server.address) as client:
            capabilities = {}
            for key in ("a", "b", "c", "pinned"):
                capabilities[key] = (await client.put(key, "fp", bytes(1000))).capability
            for key in ("a", "b", "c"):
                await client.release(key, capabilities[key])
            await client.get("a", "fp", capabilities["a"])
            await client.put("new", "fp", bytes(2000))
            present = {
                key
                for key, capability in capabilities.items()
                if (await client.stat(key, capability)).HasField("object")
            }
            assert present == {"a", "pinned"}
            stats = await client.stat()
            assert (stats.evictions, stats.bytes) == (2, 4000)
            assert stats.bytes + stats.pooled_bytes <= stats.capacity_bytes

    asyncio.run(body())


@PATHS
@pytest.mark.timeout(60)
def test_32_concurrent_writers_and_readers_stay_correct(prefer_shm: bool):
    async def body():
        async with (
            running_store() as server,
            KvStoreClient(server.address, prefer_shm=prefer_shm, chunk_bytes=CHUNK) as client,
        ):
            payloads = {f"w{i}": random.randbytes(random.randrange(0, 300_000)) for i in range(32)}

            async def writer_then_reader(key: str) -> None:
                capability = (await client.put(key, "fp", payloads[key])).capability
                for _ in range(3):
                    data, _ = await client.get(key, "fp", capability)
                    assert bytes(data) == payloads[key]
                assert await client.release(key, capability)

            await asyncio.gather(*(writer_then_reader(key) for key in payloads))
            stats = await client.stat()
            assert (stats.objects, stats.pinned_bytes, stats.reserved_bytes) == (32, 0, 0)
            assert stats.bytes == sum(map(len, payloads.values()))

    asyncio.run(body())


@PATHS
@pytest.mark.timeout(60)
def test_concurrent_large_gets_keep_every_held_result_intact_while_buffers_are_reused(prefer_shm: bool):
    async def body():
        async with (
            running_store() as server,
            KvStoreClient(server.address, prefer_shm=prefer_shm, receive_pool_bytes=48 << 20) as client,
        ):
            sizes = [(2 << 20) + 1, 3 << 20, (17 << 20) + 3, 5 << 20, (16 << 20) - 7, 2 << 20]
            payloads = {f"big{i}": random.randbytes(size) for i, size in enumerate(sizes)}
            capabilities = {
                key: (await client.put(key, "fp", data)).capability for key, data in payloads.items()
            }

            async def read(key: str) -> memoryview:
                data, _ = await client.get(key, "fp", capabilities[key])
                return data

            held = await asyncio.gather(*(read(key) for key in payloads))  # all held at once
            for _ in range(2):  # dropped results are reused by later gets, held ones never
                again = await asyncio.gather(*(read(key) for key in reversed(payloads)))
                assert [bytes(d) for d in reversed(again)] == list(payloads.values())
                del again
            assert [bytes(d) for d in held] == list(payloads.values())

    asyncio.run(body())


def test_stop_frees_every_segment():
    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            await client.put("k", "fp", bytes(10_000))
            segments = server.servicer.segments
        assert not list(segments.directory.glob(f"pcpkv-{segments.token}*"))

    asyncio.run(body())


async def _raw_get(address: str, request: pb.GetRequest) -> grpc.aio.AioRpcError | list[pb.GetResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = kvstore_pb2_grpc.KvStoreServiceStub(channel).Get(iter([request]), timeout=10)
        try:
            return [message async for message in call]
        except grpc.aio.AioRpcError as exc:
            return exc


@PATHS
def test_get_without_the_capability_is_permission_denied_naming_the_key(prefer_shm: bool):
    async def body():
        async with running_store() as server, KvStoreClient(server.address, prefer_shm=prefer_shm) as client:
            committed = await client.put("req-1/abc", "fp", b"secret kv" * 1000)
            other = await client.put("req-2/abc", "fp", b"other kv")
            for presented in ("", "forged-token", other.capability):
                request = pb.GetRequest(
                    key="req-1/abc", fingerprint="fp", capability=presented, accept_shm=prefer_shm
                )
                error = await _raw_get(server.address, request)
                assert isinstance(error, grpc.aio.AioRpcError)
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "'req-1/abc'" in error.details() and committed.capability not in error.details()
                with pytest.raises(CapabilityDenied, match="req-1/abc"):
                    await client.get("req-1/abc", "fp", presented)
            stats = await client.stat()
            assert (stats.bytes_out, server.servicer.store.find("req-1/abc").readers) == (0, 0)
            data, _ = await client.get("req-1/abc", "fp", committed.capability)
            assert bytes(data) == b"secret kv" * 1000

    asyncio.run(body())


def test_release_and_delete_without_the_capability_are_refused_and_leave_the_pin():
    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            committed = await client.put("k", "fp", b"abc")
            for refused in (client.release("k", ""), client.delete("k", "forged-token")):
                with pytest.raises(CapabilityDenied, match="'k'"):
                    await refused
            stats = await client.stat("k", committed.capability)
            assert (stats.object.pinned, stats.pinned_bytes, stats.objects) == (True, 3, 1)
            assert await client.release("k", committed.capability) is True
            assert await client.delete("k", committed.capability) is True

    asyncio.run(body())


def test_stat_shows_counters_to_anyone_and_an_object_only_with_its_capability():
    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            committed = await client.put("k", "fp", b"abc")
            for presented in ("", "forged-token"):
                anonymous = await client.stat("k", presented)
                assert (anonymous.objects, anonymous.bytes) == (1, 3)
                assert not anonymous.HasField("object")
            holder = await client.stat("k", committed.capability)
            assert (holder.object.key, holder.object.total_bytes, holder.object.pinned) == ("k", 3, True)
            # The capability travels in the commit's answer only: never back out of Stat.
            assert committed.capability.encode() not in holder.SerializeToString()

    asyncio.run(body())


def test_capability_is_kept_out_of_the_put_result_repr():
    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            committed = await client.put("k", "fp", b"abc")
            assert len(committed.capability) >= 32 and committed.capability not in repr(committed)

    asyncio.run(body())


@pytest.mark.parametrize("lease_ms", [5001, 2**32 - 1], ids=["just-above", "49-days"])
def test_lease_above_the_cap_is_invalid_argument_naming_the_cap(lease_ms: int):
    async def body():
        async with (
            running_store(default_lease_ms=1000, max_lease_ms=5000) as server,
            KvStoreClient(server.address) as client,
        ):
            header = pb.PutHeader(key="k", fingerprint="fp", total_bytes=4, chunk_size=4, lease_ms=lease_ms)
            error = await _raw_put(server.address, [pb.PutRequest(header=header)])
            assert isinstance(error, grpc.aio.AioRpcError)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cap of 5000 ms" in error.details() and f"lease_ms={lease_ms}" in error.details()
            with pytest.raises(InvalidArgument, match="cap of 5000 ms"):
                await client.put("k", "fp", b"abcd", lease_ms=lease_ms)
            stats = await client.stat()
            assert (stats.objects, stats.reserved_bytes, stats.refused_puts) == (0, 0, 2)
            assert (stats.default_lease_ms, stats.max_lease_ms) == (1000, 5000)
            assert (await client.put("k", "fp", b"abcd", lease_ms=5000)).total_bytes == 4

    asyncio.run(body())


def test_a_prefill_set_keeps_an_answer_for_the_lease_its_push_asked_or_the_stores_default():
    """What a set keeps Abandon's rights for (LeaseBounds): the push's lease, else the store's default lease
    as its Stat tells, asked again after REFRESH_S (a store restarted with another default); a store that
    does not answer gets the longest default."""
    now = [0.0]

    async def body():
        async with (
            running_store(default_lease_ms=1000, max_lease_ms=5000) as first,
            running_store(default_lease_ms=2000, max_lease_ms=5000) as restarted,
            KvStoreClient(first.address) as before,
            KvStoreClient(restarted.address) as after,
            KvStoreClient(f"127.0.0.1:{free_port()}", deadline_s=5.0) as silent,
        ):
            clients = {"store": before, "silent": silent}
            bounds = LeaseBounds(clients.__getitem__, clock=lambda: now[0])
            asked = (await bounds.bound_ms("store", 300), await bounds.bound_ms("store", 0))
            clients["store"] = after  # the store came back with a longer default lease
            now[0] += LeaseBounds.REFRESH_S - 1
            cached = await bounds.bound_ms("store", 0)
            now[0] += 1
            return asked, cached, await bounds.bound_ms("store", 0), await bounds.bound_ms("silent", 0)

    asked, cached, refreshed, silent = asyncio.run(body())
    assert (asked, cached, refreshed, silent) == ((300, 1000), 1000, 2000, DEFAULT_MAX_LEASE_MS)


def test_store_caps_leases_at_ten_minutes_by_default():
    async def body():
        async with running_store() as server, KvStoreClient(server.address) as client:
            with pytest.raises(InvalidArgument, match="cap of 600000 ms"):
                await client.put("k", "fp", b"abcd", lease_ms=2**32 - 1)

    asyncio.run(body())


@PATHS
def test_refused_put_and_get_leave_no_task_to_be_destroyed_pending(prefer_shm: bool, caplog):
    async def body():
        async with running_store() as server, KvStoreClient(server.address, prefer_shm=prefer_shm) as client:
            committed = await client.put("k", "fp", b"abc")
            with pytest.raises(AlreadyExists):
                await client.put("k", "fp", b"abc")
            with pytest.raises(InvalidArgument, match="cap"):
                await client.put("long", "fp", b"abc", lease_ms=2**32 - 1)
            for key, capability in (("k", "forged-token"), ("missing", committed.capability)):
                with pytest.raises((CapabilityDenied, NotFound)):
                    await client.get(key, "fp", capability)
            with pytest.raises(FingerprintMismatch):
                await client.get("k", "other-model", committed.capability)
            for _ in range(3):  # the loop runs what the failed calls left to finish
                await asyncio.sleep(0)
            gc.collect()  # a request stream still waiting would now be destroyed, pending

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(body())
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


@pytest.mark.timeout(60)
def test_objects_of_changing_sizes_in_reused_segments_read_back_exactly_on_every_path():
    """One pooled segment serves puts of changing sizes: kept whole for a slightly smaller object, shrunk
    for a much smaller one, grown for a larger one. Every object reads back exactly, whole through shared
    memory or gRPC and ranged, however much larger than the object its segment is."""

    async def body():
        async with (
            running_store(standby_min_bytes=0) as server,  # no standby segments beside the one pooled
            KvStoreClient(server.address) as writer,
            KvStoreClient(server.address, prefer_shm=False, chunk_bytes=CHUNK) as streamed,
        ):
            assert await writer.uses_shm()
            # (object size, the pooled segment's size once the object is deleted)
            for i, (size, pooled) in enumerate(
                [
                    (8 << 20, 8 << 20),
                    ((7 << 20) + 1, 8 << 20),
                    (2 << 20, 2 << 20),
                    ((9 << 20) + 5, (9 << 20) + 5),
                ]
            ):
                payload = random.randbytes(size)
                replica = await writer.put(f"k{i}", "fp", payload)
                for reader in (writer, streamed):
                    data, _ = await reader.get(replica.key, "fp", replica.capability)
                    assert bytes(data) == payload
                    del data
                    tail = ByteRange(offset=size - 1000, length=1000)
                    data, _ = await reader.get(replica.key, "fp", replica.capability, ranges=[tail])
                    assert bytes(data) == payload[-1000:]
                    del data
                assert await writer.delete(replica.key, replica.capability)
                assert (await writer.stat()).pooled_bytes == pooled
                assert len(segment_files(server)) == 1

    asyncio.run(body())


def test_shm_put_in_a_larger_reused_segment_with_its_last_byte_flipped_is_rejected():
    """The store checks exactly the object's bytes of a segment kept larger than the object: a flip in the
    object's last byte is refused, and the segment's slack past the object plays no part."""

    async def body():
        async with (
            running_store() as server,
            KvStoreClient(server.address) as client,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            earlier = await client.put("earlier", "fp", random.randbytes(4 << 20))
            assert await client.delete(earlier.key, earlier.capability)
            size = (7 << 19) + 3  # the pooled 4 MiB segment is at most a quarter larger: reused as it is
            name = await _shm_put_with_a_flipped_byte(server, channel, size, offset=size - 1, mask=0x80)
            assert os.path.getsize(os.path.join(server.servicer.segments.directory, name)) == 4 << 20
            stats = await _settled(server, lambda s: (s.objects, s.reserved_bytes) == (0, 0))
            assert (stats.objects, stats.reserved_bytes) == (0, 0)
            assert server.servicer.segments.pooled_bytes == 4 << 20

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_a_large_shm_put_names_a_standby_segment_that_the_writers_next_put_fills():
    """An object that lives on keeps its segment, so the store prepares a standby one for the writer's
    next put; the writer maps it between puts, and that put lands in it, even straight after."""

    async def body():
        async with running_store() as server, KvStoreClient(server.address) as writer:
            prepare = server.servicer.segments.prepare
            priority = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            prepared_on = []

            def slow_prepare(segment) -> None:  # as on a loaded machine: the writer comes back first
                thread = threading.get_native_id()
                prepared_on.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, thread)))
                time.sleep(0.5)
                prepare(segment)

            server.servicer.segments.prepare = slow_prepare
            await writer.put("small", "fp", bytes(1 << 20))
            assert writer.standby_shm_name == ""  # under standby_min_bytes: a fresh mapping costs little
            maps, mapped_on = writer._segments, []
            prefetch = maps.prefetch

            def recording_prefetch(name: str) -> bool:
                mapped_on.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                return prefetch(name)

            maps.prefetch = recording_prefetch
            payloads = {key: random.randbytes(8 << 20) for key in ("first", "second")}
            first = await writer.put("first", "fp", payloads["first"])
            standby = writer.standby_shm_name
            assert standby in [path.name for path in segment_files(server)]
            assert server.servicer.store.find("first").payload.name != standby
            # At once: the store finishes preparing the standby first if it must, the writer maps it itself
            # if its own thread has not yet.
            second = await writer.put("second", "fp", payloads["second"])
            assert server.servicer.store.find("second").payload.name == standby
            assert writer.standby_shm_name not in ("", standby)  # the next one, for the put after
            # prepared on the store's thread of background priority: a reader's fetch gets the cores first
            assert prepared_on[0][0].startswith("kv-standby")
            assert prepared_on[0][1] == min(19, priority + BACKGROUND_NICE)
            writer.wait_for_standby(timeout=10)  # and the writer maps its standbys in the background too
            assert mapped_on and set(mapped_on) == {min(19, priority + BACKGROUND_NICE)}
            async with KvStoreClient(server.address, prefer_shm=False, chunk_bytes=CHUNK) as streamed:
                for replica in (first, second):
                    for reader in (writer, streamed):
                        data, _ = await reader.get(replica.key, "fp", replica.capability)
                        assert bytes(data) == payloads[replica.key]
                        del data

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_no_standby_when_the_pool_has_no_room_or_the_store_has_them_off():
    async def body():
        # 20 MiB: a 12 MiB object leaves 8 MiB free, too little for a 12 MiB standby.
        async with running_store(capacity_bytes=20 << 20) as server, KvStoreClient(server.address) as writer:
            await writer.put("big", "fp", bytes(12 << 20))
            assert writer.standby_shm_name == "" and len(segment_files(server)) == 1
        async with (
            running_store(standby_min_bytes=0) as server,
            KvStoreClient(server.address) as writer,
        ):
            await writer.put("big", "fp", bytes(12 << 20))
            assert writer.standby_shm_name == "" and len(segment_files(server)) == 1
        with pytest.raises(ValueError, match="standby_min_bytes must be >= 0"):
            KvStoreServerConfig(capacity_bytes=1 << 20, standby_min_bytes=-1)

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_a_store_full_of_released_objects_evicts_the_oldest_for_a_standby():
    """A store that has run a while is full of released replicas kept for reuse: the standby takes the
    room of the least recently used one (the segment it leaves, as it is), which the writer's next put
    would have evicted anyway; a pinned object is never evicted for it."""

    async def body():
        size = 8 << 20
        async with running_store(capacity_bytes=4 * size) as server, KvStoreClient(server.address) as writer:
            store = server.servicer.store

            async def put(key: str, release: bool) -> str:
                """Puts into the standby the last put named; returns the segment the object landed in."""
                held = writer.standby_shm_name
                writer.wait_for_standby(timeout=10)
                stored = await writer.put(key, "fp", random.randbytes(size))
                if release:
                    assert await writer.release(stored.key, stored.capability)
                assert held in ("", store.find(key).payload.name)
                return store.find(key).payload.name

            oldest = await put("o0", release=True)
            for key in ("o1", "o2"):
                await put(key, release=True)
            assert store.stats().evictions == 0  # standbys so far in free room
            await put("o3", release=True)  # the store is full now: o0 goes for o3's standby
            assert store.stats().evictions == 1 and store.find("o0") is None
            assert writer.standby_shm_name == oldest and store.free_bytes() == size
            await put("o4", release=False)  # into that standby, evicting nothing itself; o1 goes for the next
            assert store.stats().evictions == 2 and store.find("o1") is None
            for key in ("o5", "o6"):
                await put(key, release=False)
            assert store.stats().evictions == 4 and store.find("o3") is None
            await put("o7", release=False)  # every object pinned: no room to make, no standby
            assert writer.standby_shm_name == "" and store.stats().evictions == 4
            assert [key for key in (f"o{i}" for i in range(8)) if store.find(key)] == ["o4", "o5", "o6", "o7"]

        # Standbys evict for at most a quarter of the capacity: here one would take a third.
        async with running_store(capacity_bytes=3 * size) as server, KvStoreClient(server.address) as writer:
            for index in range(3):
                writer.wait_for_standby(timeout=10)
                stored = await writer.put(f"o{index}", "fp", random.randbytes(size))
                assert await writer.release(stored.key, stored.capability)
            assert writer.standby_shm_name == "" and server.servicer.store.stats().evictions == 0

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_two_writers_taking_turns_each_put_into_their_own_standby():
    async def body():
        async with (
            running_store() as server,
            KvStoreClient(server.address) as one,
            KvStoreClient(server.address) as other,
        ):
            for turn in range(3):
                for name, writer in (("one", one), ("other", other)):
                    held = writer.standby_shm_name
                    writer.wait_for_standby(timeout=10)
                    await writer.put(f"{name}-{turn}", "fp", random.randbytes(8 << 20))
                    if turn:  # from the second turn on, each put lands in the standby its writer held
                        assert server.servicer.store.find(f"{name}-{turn}").payload.name == held
            assert one.standby_shm_name != other.standby_shm_name

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_a_writer_that_announces_puts_of_a_repeating_size_gets_the_next_standby_after_each_put():
    """Prompts of one length (a benchmark, a fixed context): once a put repeats the size of the one before
    it, the store readies the next standby right after the put, between requests, and the next announcement
    finds it held rather than readying one during the forward; a put of another size goes back to asking."""

    async def body():
        async with running_store() as server, KvStoreClient(server.address) as writer:
            store, size = server.servicer.store, 10 << 20
            for index in range(2):
                standby = await writer.prepare_put(size)
                writer.wait_for_standby(timeout=10)
                await writer.put(f"o{index}", "fp", random.randbytes(size))
                assert store.find(f"o{index}").payload.name == standby
            after_put = writer.standby_shm_name  # the second put repeated the first one's size
            assert after_put and after_put != standby
            assert (
                await writer.prepare_put(size - (1 << 20)) == after_put
            )  # held, and holds 9 MiB: no new one
            writer.wait_for_standby(timeout=10)
            await writer.put("o2", "fp", random.randbytes(size - (1 << 20)))
            assert store.find("o2").payload.name == after_put
            assert writer.standby_shm_name  # 9 MiB after 10 repeats it too
            other = await writer.prepare_put(3 * size)  # another length: asked for, as before
            assert other and other != after_put
            writer.wait_for_standby(timeout=10)
            await writer.put("o3", "fp", random.randbytes(3 * size))
            assert store.find("o3").payload.name == other and writer.standby_shm_name == ""

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_a_writer_that_announces_each_puts_size_gets_a_standby_of_that_size_before_it():
    """Puts of sizes unlike each other (prompts of any length): each announced with PrepareStandby lands
    in the standby readied for it; after such puts the store names no standby of its own; sizes under the
    store's standby size cost no call."""

    async def body():
        async with running_store() as server, KvStoreClient(server.address) as writer:
            store, segments = server.servicer.store, server.servicer.segments
            assert await writer.prepare_put(1 << 20) == ""  # under standby_min_bytes (from Stat): no call
            for index, size in enumerate((12 << 20, 9 << 20, 20 << 20, 9 << 20)):
                standby = await writer.prepare_put(size)
                assert standby and writer.standby_shm_name == standby
                writer.wait_for_standby(timeout=10)
                await writer.put(f"o{index}", "fp", random.randbytes(size))
                assert store.find(f"o{index}").payload.name == standby
                assert writer.standby_shm_name == ""  # the store readies the next one when asked
            assert (await writer.stat()).standby_puts == segments.standby_puts == 4

            async with KvStoreClient(server.address) as other:  # a writer that does not announce its puts
                await other.put("p0", "fp", random.randbytes(12 << 20))
                assert other.standby_shm_name != ""  # still gets one after each put

            for size in (0, (1 << 30) + 1):
                with pytest.raises(InvalidArgument, match=r"size_bytes must be in 1\.\.1073741824"):
                    await writer._unary(
                        writer._stub.PrepareStandby, pb.PrepareStandbyRequest(size_bytes=size)
                    )

    asyncio.run(body())
