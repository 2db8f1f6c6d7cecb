"""The hand-written chunk encoding is exactly what protobuf produces, for both messages that carry it, and the
hand-written chunk parser reads what protobuf reads or leaves the message to it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pcpstack.kvstore.wire import Chunk, body_of, chunk_of, encode_chunk, parse_chunk, parse_with
from pcpstack.v1 import kvstore_pb2 as pb


@given(st.integers(0, 2**64 - 1), st.binary(max_size=1000), st.integers(0, 2**32 - 1))
def test_encode_chunk_matches_protobuf(offset: int, data: bytes, crc: int):
    chunk = pb.PutChunk(offset=offset, data=data, crc32c=crc)
    encoded = encode_chunk(offset, memoryview(data), crc)
    assert encoded == pb.PutRequest(chunk=chunk).SerializeToString()
    assert encoded == pb.GetResponse(chunk=chunk).SerializeToString()


@given(st.integers(0, 2**64 - 1), st.binary(max_size=1000), st.integers(0, 2**32 - 1))
def test_parse_chunk_reads_what_protobuf_reads_as_a_view_of_the_message(offset: int, data: bytes, crc: int):
    raw = pb.PutRequest(chunk=pb.PutChunk(offset=offset, data=data, crc32c=crc)).SerializeToString()
    chunk = parse_chunk(raw)
    assert (chunk.offset, bytes(chunk.data), chunk.crc32c) == (offset, data, crc)
    assert chunk.data.obj is raw  # a view, not a copy


@given(
    st.permutations([b"\x08\x07", b"\x12\x03abc", b"\x18\x05", b"\x12\x02xy", b"\x08\x09"]),
)
def test_parse_chunk_takes_fields_in_any_order_and_repeats_as_protobuf_does(fields: list[bytes]):
    body = b"".join(fields)
    raw = b"\x12" + bytes([len(body)]) + body
    expected = pb.PutRequest.FromString(raw).chunk  # the last occurrence of a field wins
    chunk = parse_chunk(raw)
    assert (chunk.offset, bytes(chunk.data)) == (expected.offset, expected.data)
    assert chunk.crc32c == expected.crc32c


@pytest.mark.parametrize(
    "raw",
    [
        pb.PutRequest(header=pb.PutHeader(key="k", total_bytes=4)).SerializeToString(),
        pb.PutRequest(commit=pb.PutCommit(crc32c=7)).SerializeToString(),
        pb.GetResponse(header=pb.GetHeader(total_bytes=4)).SerializeToString(),
        b"\x12\x06\x12\x02ab\x20\x01",  # an unknown field 4 inside the chunk
        b"\x12\x04\x12\x02ab\x1a\x00",  # the chunk followed by another top-level field
        b"\x12\x04\x12\x09ab",  # data longer than its message
        b"\x12\x06\x18\xff\xff\xff\xff\x1f",  # a crc32c above 32 bits, which protobuf truncates
        b"\x12\x02\x08\xff",  # a varint cut short
        b"",
    ],
    ids=[
        *("put-header", "commit", "get-header", "unknown-field", "trailing"),
        *("overrun", "wide-crc", "cut", "empty"),
    ],
)
def test_parse_chunk_leaves_every_other_message_to_protobuf(raw: bytes):
    assert parse_chunk(raw) is None


def test_parse_with_gives_a_chunk_or_the_generated_message():
    parse = parse_with(pb.PutRequest)
    chunk = parse(encode_chunk(4, memoryview(b"abcd"), 9))
    assert isinstance(chunk, Chunk) and (body_of(chunk), chunk_of(chunk)) == ("chunk", chunk)
    commit = parse(pb.PutRequest(commit=pb.PutCommit(crc32c=7)).SerializeToString())
    assert body_of(commit) == "commit" and commit.commit.crc32c == 7
    odd = parse(b"\x12\x06\x12\x02ab\x20\x01")  # a chunk only protobuf reads
    assert body_of(odd) == "chunk" and chunk_of(odd).data == b"ab"
