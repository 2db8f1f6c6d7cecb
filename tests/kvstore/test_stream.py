"""The chunk rules both ends share, without gRPC: what a sender cuts, a receiver reassembles and verifies;
what breaks the rules is refused as the kind the receiving side names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pcpstack.kvstore.checksum import crc32c
from pcpstack.kvstore.errors import ChecksumMismatch, ProtocolError
from pcpstack.kvstore.shm import copy_with_crc
from pcpstack.kvstore.stream import ChunkReceiver, ChunkSender
from pcpstack.v1 import kvstore_pb2 as pb


def _chunks(data: bytes, chunk_size: int) -> tuple[list[pb.PutChunk], int]:
    """The chunks a sender makes of data (parsed back from the wire) and the object's CRC it computed."""
    sender = ChunkSender(len(data), chunk_size)
    view = memoryview(data)
    chunks = [
        pb.PutRequest.FromString(sender.encode(offset, view[offset : offset + length])).chunk
        for offset, length in sender.spans()
    ]
    return chunks, sender.crc32c


def _receiver(total: int, chunk_size: int, into: bytearray) -> ChunkReceiver:
    def copy(offset: int, data: memoryview) -> int:
        into[offset : offset + len(data)] = data
        return crc32c(into[offset : offset + len(data)])

    return ChunkReceiver("k", total, chunk_size, copy, malformed=ProtocolError)


@given(st.binary(max_size=2000), st.integers(1, 300))
def test_what_the_sender_cuts_the_receiver_reassembles_and_verifies(data: bytes, chunk_size: int):
    chunks, crc = _chunks(data, chunk_size)
    out = bytearray(len(data))
    receiver = _receiver(len(data), chunk_size, out)
    for chunk in chunks:
        receiver.add(chunk)
    assert receiver.finish(crc, "the sender") == crc32c(data) == crc
    assert bytes(out) == data
    assert all(len(c.data) == chunk_size for c in chunks[:-1])


def test_chunk_out_of_order_is_the_receivers_malformed_kind():
    chunks, _ = _chunks(b"abcdefgh", 4)
    with pytest.raises(ProtocolError, match="offset 4"):
        _receiver(8, 4, bytearray(8)).add(chunks[1])


def test_chunk_whose_bytes_differ_from_its_crc_is_checksum_mismatch():
    chunks, _ = _chunks(b"abcdefgh", 4)
    chunks[1].data = b"efgX"
    receiver = _receiver(8, 4, bytearray(8))
    receiver.add(chunks[0])
    with pytest.raises(ChecksumMismatch, match="offset 4"):
        receiver.add(chunks[1])


def test_stream_that_ends_early_or_announces_another_crc_is_refused():
    chunks, crc = _chunks(b"abcdefgh", 4)
    short = _receiver(8, 4, bytearray(8))
    short.add(chunks[0])
    with pytest.raises(ProtocolError, match="total_bytes=8"):
        short.finish(crc, "the sender")
    whole = _receiver(8, 4, bytearray(8))
    for chunk in chunks:
        whole.add(chunk)
    with pytest.raises(ChecksumMismatch, match="the sender says"):
        whole.finish(crc ^ 1, "the sender")


def _fused_receiver(total: int, chunk_size: int, place: memoryview) -> ChunkReceiver:
    """A receiver copying as the store and the client do: the CRC32C comes from the pass that copies."""

    def copy(offset: int, data: memoryview) -> int:
        return copy_with_crc(place[offset : offset + len(data)], [data])

    return ChunkReceiver("k", total, chunk_size, copy, malformed=ProtocolError)


def test_receiver_copying_with_the_fused_copy_lands_every_byte_and_refuses_a_corrupt_chunk():
    data = bytes(range(256)) * 4099  # not a multiple of the chunk size
    chunks, crc = _chunks(data, 65_537)
    out = bytearray(len(data))
    receiver = _fused_receiver(len(data), 65_537, memoryview(out))
    for chunk in chunks:
        receiver.add(chunk)
    assert receiver.finish(crc, "the sender") == crc
    assert bytes(out) == data
    chunks[3].data = chunks[3].data[:-1] + bytes([chunks[3].data[-1] ^ 1])
    again = _fused_receiver(len(data), 65_537, memoryview(bytearray(len(data))))
    for chunk in chunks[:3]:
        again.add(chunk)
    with pytest.raises(ChecksumMismatch, match=f"offset {3 * 65_537}"):
        again.add(chunks[3])
