"""Hand-written protobuf encoding of the one message on the hot path: a chunk of bytes.

Building a PutRequest/GetResponse around a multi-MiB bytes field copies the bytes twice (into the message,
then into the serialised string); writing the wire format directly copies them once, straight from the
caller's buffer. The result is byte-for-byte what protobuf would produce (tests/kvstore/test_wire.py), so
the peer parses it with the generated classes.
"""

from __future__ import annotations

SERVICE_NAME = "pcpstack.v1.KvStoreService"  # full name of the service, for hand-registered methods

# `chunk` is field 2 of both PutRequest and GetResponse; in PutChunk, offset = 1, data = 2, crc32c = 3.
_CHUNK_TAG = b"\x12"
_OFFSET_TAG = b"\x08"
_DATA_TAG = b"\x12"
_CRC_TAG = b"\x18"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(offset: int, data, crc32c: int) -> bytes:
    """A serialised PutRequest (or GetResponse) whose body is PutChunk(offset, data, crc32c)."""
    length = len(data)
    head = (_OFFSET_TAG + _varint(offset) if offset else b"") + (
        _DATA_TAG + _varint(length) if length else b""
    )
    tail = _CRC_TAG + _varint(crc32c) if crc32c else b""
    return b"".join((_CHUNK_TAG, _varint(len(head) + length + len(tail)), head, data, tail))


def serialize(message) -> bytes:
    """Request/response serializer that passes pre-encoded chunks through and serialises the rest."""
    return message if isinstance(message, bytes) else message.SerializeToString()
