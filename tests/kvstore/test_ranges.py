"""Ranged Gets over real gRPC: a DCP rank's strided share of a replica on both paths, checksummed chunks,
and bad ranges refused naming the field."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from pcpstack.kvstore.checksum import crc32c
from pcpstack.kvstore.client import ByteRange, ByteRepeat, KvStoreClient
from pcpstack.kvstore.errors import InvalidArgument
from pcpstack.v1 import kvstore_pb2 as pb
from pcpstack.v1 import kvstore_pb2_grpc
from tests.kvstore.conftest import running_store

PATHS = pytest.mark.parametrize("prefer_shm", [False, True], ids=["grpc", "shm"])
# A replica shard [planes, tokens, kv_heads, head_dim] of uint8 "elements": 37 tokens, blocks of 4 tokens.
PLANES, TOKENS, HEADS, HEAD_DIM, BLOCK = 6, 37, 3, 8, 4


def _replica() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (PLANES, TOKENS, HEADS, HEAD_DIM), dtype=np.uint8)


def _dcp_share(rank: int, size: int, head: int) -> tuple[list[ByteRange], np.ndarray]:
    """The ranges of DCP rank `rank`'s blocks of K/V head `head` in every plane, and what they must give."""
    row, plane = HEADS * HEAD_DIM, TOKENS * HEADS * HEAD_DIM
    starts = list(range(rank * BLOCK, TOKENS, size * BLOCK))
    full = [s for s in starts if s + BLOCK <= TOKENS]
    ranges = [
        ByteRange(
            full[0] * row + head * HEAD_DIM,
            HEAD_DIM,
            (ByteRepeat(plane, PLANES), ByteRepeat(size * BLOCK * row, len(full)), ByteRepeat(row, BLOCK)),
        )
    ]
    tail = [s for s in starts if s + BLOCK > TOKENS]
    if tail:  # the last, short block
        ranges.append(
            ByteRange(
                tail[0] * row + head * HEAD_DIM,
                HEAD_DIM,
                (ByteRepeat(plane, PLANES), ByteRepeat(row, TOKENS - tail[0])),
            )
        )
    replica = _replica()
    expected = [replica[:, [t for s in full for t in range(s, s + BLOCK)], head]]
    expected += [replica[:, tail[0] :, head]] if tail else []
    return ranges, np.concatenate([part.reshape(-1) for part in expected])


@PATHS
@pytest.mark.timeout(60)
def test_ranged_get_returns_only_a_dcp_ranks_blocks_of_one_head(prefer_shm: bool):
    async def body():
        async with (
            running_store() as server,
            KvStoreClient(server.address, prefer_shm=prefer_shm, chunk_bytes=256) as client,
        ):
            replica = _replica()
            committed = await client.put("r", "fp", replica)
            sent_before = (await client.stat()).bytes_out
            for rank in range(3):
                ranges, expected = _dcp_share(rank, 3, head=1)
                data, _ = await client.get("r", "fp", committed.capability, ranges=ranges)
                assert bytes(data) == expected.tobytes()
            # The store counts what it delivered: the three shares of one head, a third of the object.
            sent = (await client.stat()).bytes_out - sent_before
            assert sent == replica.nbytes // HEADS

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_ranged_stream_chunks_carry_the_selection_with_checksums_combining_to_the_header():
    async def body():
        async with running_store() as server, grpc.aio.insecure_channel(server.address) as channel:
            async with KvStoreClient(server.address, prefer_shm=False) as client:
                committed = await client.put("r", "fp", _replica())
            ranges, expected = _dcp_share(1, 2, head=2)
            call = kvstore_pb2_grpc.KvStoreServiceStub(channel).Get(timeout=10)
            request = pb.GetRequest(
                key="r",
                fingerprint="fp",
                capability=committed.capability,
                max_chunk_size=100,
                ranges=[r.to_wire() for r in ranges],
            )
            await call.write(request)
            await call.done_writing()
            header = (await call.read()).header
            chunks = []
            while (message := await call.read()) is not grpc.aio.EOF:
                chunks.append(message.chunk)
            assert header.total_bytes == _replica().nbytes and header.selected_bytes == expected.nbytes
            assert header.selected_crc32c == crc32c(expected.tobytes())
            assert [c.offset for c in chunks] == list(range(0, expected.nbytes, 100))
            assert all(c.crc32c == crc32c(c.data) for c in chunks)
            assert b"".join(c.data for c in chunks) == expected.tobytes()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("ranges", "field"),
    [
        ([ByteRange(0, 16), ByteRange(PLANES * TOKENS * HEADS * HEAD_DIM - 8, 16)], "ranges[1]"),
        ([ByteRange(0, 0)], "ranges[0].length=0"),
        ([ByteRange(0, 8, (ByteRepeat(64, 0),))], "ranges[0].repeats[0].count=0"),
        ([ByteRange(0, 8, (ByteRepeat(0, 3),))], "ranges[0].repeats[0].stride=0"),
        ([ByteRange(2**64 - 8, 16)], "ranges[0]: offset=18446744073709551608"),
        ([ByteRange(0, 8, (ByteRepeat(8, 2**63), ByteRepeat(2**62, 4)))], "ranges[0]"),
        ([ByteRange(0, 8, (ByteRepeat(2**63, 1),))], "ranges[0].repeats[0].stride=9223372036854775808"),
    ],
    ids=[
        "beyond",
        "zero-length",
        "zero-count",
        "zero-stride",
        "offset-overflow",
        "repeat-overflow",
        "huge-stride",
    ],
)
def test_bad_range_is_invalid_argument_naming_the_field(ranges, field):
    async def body():
        # The store checks the ranges before it picks a path, so one path shows it.
        async with running_store() as server, KvStoreClient(server.address) as client:
            committed = await client.put("r", "fp", _replica())
            with pytest.raises(InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
                await client.get("r", "fp", committed.capability, ranges=ranges)
            stats = await client.stat("r", committed.capability)
            assert stats.object.readers == 0 and stats.object.pinned  # the refused read left no trace

    asyncio.run(body())
