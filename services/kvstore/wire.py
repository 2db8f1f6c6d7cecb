"""Hand-written protobuf encoding of the one message on the hot path: a chunk of bytes.

Building a PutRequest/GetResponse around a multi-MiB bytes field copies the bytes twice (into the message,
then into the serialised string); writing the wire format directly copies them once, straight from the
caller's buffer. The result is byte-for-byte what protobuf would produce (tests/kvstore/test_wire.py), so
the peer parses it with the generated classes.

The receiving side reads a chunk message by hand too (`parse_chunk`): the generated class copies the bytes
when its data field is read, a view of the received message does not. Any other message, and any chunk
message in a form the hand parser does not take, goes to the generated class.
"""

from __future__ import annotations

from dataclasses import dataclass

from pcpstack.v1 import kvstore_pb2 as pb

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


@dataclass(frozen=True, slots=True)
class Chunk:
    """A PutChunk read straight from its message's wire bytes: data is a view of them, not a copy (the
    generated class copies a chunk's bytes once more when its data field is read)."""

    offset: int
    data: memoryview
    crc32c: int


_MAX_VARINT_BYTES = 10


def _read_varint(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); value -1 for a varint cut short or longer than protobuf allows."""
    value = shift = 0
    for i in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = raw[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return -1, end


def parse_chunk(raw: bytes) -> Chunk | None:
    """The chunk of a serialised PutRequest or GetResponse that holds a chunk and nothing else, in any field
    order; None for every other message (a header, a commit, unknown fields, a malformed one), which the
    generated class then parses as always, so a message means the same either way."""
    if not raw or raw[0] != _CHUNK_TAG[0]:
        return None
    length, pos = _read_varint(raw, 1, len(raw))
    if length < 0 or pos + length != len(raw):
        return None
    view = memoryview(raw)
    offset, data, crc = 0, view[pos:pos], 0
    while pos < len(raw):
        tag = raw[pos]
        if tag == _DATA_TAG[0]:
            size, pos = _read_varint(raw, pos + 1, len(raw))
            if size < 0 or pos + size > len(raw):
                return None
            data, pos = view[pos : pos + size], pos + size
        elif tag in (_OFFSET_TAG[0], _CRC_TAG[0]):
            value, pos = _read_varint(raw, pos + 1, len(raw))
            if value < 0 or value >= 1 << 64 or (tag == _CRC_TAG[0] and value >= 1 << 32):
                return None  # protobuf would truncate these; let it
            if tag == _OFFSET_TAG[0]:
                offset = value
            else:
                crc = value
        else:
            return None
    return Chunk(offset, data, crc)


def parse_with(message_class):
    """A response or request deserializer: a bare chunk message as a Chunk, anything else as message_class."""

    def parse(raw: bytes):
        chunk = parse_chunk(raw)
        return chunk if chunk is not None else message_class.FromString(raw)

    return parse


def body_of(message) -> str | None:
    """Which body a message parsed by parse_with carries ("chunk" for a Chunk)."""
    return "chunk" if isinstance(message, Chunk) else message.WhichOneof("body")


def chunk_of(message) -> Chunk | pb.PutChunk:
    """The chunk a message whose body is "chunk" carries."""
    return message if isinstance(message, Chunk) else message.chunk
