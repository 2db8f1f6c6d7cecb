"""The hand-written chunk encoding is exactly what protobuf produces, for both messages that carry it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pcpstack.kvstore.wire import encode_chunk
from pcpstack.v1 import kvstore_pb2 as pb


@given(st.integers(0, 2**64 - 1), st.binary(max_size=1000), st.integers(0, 2**32 - 1))
def test_encode_chunk_matches_protobuf(offset: int, data: bytes, crc: int):
    chunk = pb.PutChunk(offset=offset, data=data, crc32c=crc)
    encoded = encode_chunk(offset, memoryview(data), crc)
    assert encoded == pb.PutRequest(chunk=chunk).SerializeToString()
    assert encoded == pb.GetResponse(chunk=chunk).SerializeToString()
