"""Every message of every proto survives serialisation, filled with non-default values."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor
from google.protobuf.message import Message

from pcpstack.v1 import common_pb2, decode_pb2, kvstore_pb2, prefill_pb2, registry_pb2

MODULES = (common_pb2, registry_pb2, prefill_pb2, kvstore_pb2, decode_pb2)
_SCALARS = {
    descriptor.FieldDescriptor.TYPE_STRING: "x-é",
    descriptor.FieldDescriptor.TYPE_BYTES: b"\x00\xff",
    descriptor.FieldDescriptor.TYPE_BOOL: True,
    descriptor.FieldDescriptor.TYPE_FLOAT: 0.5,
    descriptor.FieldDescriptor.TYPE_DOUBLE: 0.25,
}


def _fill(message: Message, depth: int = 0) -> None:
    """Sets every field (one member of each oneof) to a non-default value."""
    seen_oneofs: set[str] = set()
    for field in message.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and not oneof.name.startswith("_"):
            if oneof.name in seen_oneofs:
                continue
            seen_oneofs.add(oneof.name)
        repeated = field.is_repeated
        if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            if depth > 3:
                continue
            target = getattr(message, field.name).add() if repeated else getattr(message, field.name)
            _fill(target, depth + 1)
            if not repeated and not target.ListFields():
                target.SetInParent()
            continue
        if field.type == descriptor.FieldDescriptor.TYPE_ENUM:
            value = field.enum_type.values[-1].number
        else:
            value = _SCALARS.get(field.type, 7)
        if repeated:
            getattr(message, field.name).append(value)
        else:
            setattr(message, field.name, value)


def _all_messages():
    for module in MODULES:
        for name in module.DESCRIPTOR.message_types_by_name:
            yield pytest.param(getattr(module, name), id=f"{module.__name__.rsplit('.', 1)[-1]}.{name}")


@pytest.mark.parametrize("message_class", list(_all_messages()))
def test_message_round_trips_through_bytes(message_class: type[Message]) -> None:
    original = message_class()
    _fill(original)
    if original.DESCRIPTOR.fields:
        assert original.ByteSize() > 0
    copy = message_class.FromString(original.SerializeToString())
    assert copy == original


def test_every_field_is_commented() -> None:
    """The protos are documentation: every message, field, enum value, service and method has a comment."""
    from pathlib import Path

    missing = []
    for proto in sorted((Path(__file__).resolve().parents[2] / "protos").rglob("*.proto")):
        lines = proto.read_text().splitlines()
        for index, line in enumerate(lines):
            code = line.strip()
            is_decl = code.startswith(("message ", "enum ", "service ", "rpc ", "oneof ")) or (
                "=" in code and code.endswith(";") and not code.startswith(("syntax", "package", "option"))
            )
            if is_decl and not lines[index - 1].strip().startswith("//"):
                missing.append(f"{proto.name}:{index + 1}: {code}")
    assert not missing, "uncommented declarations:\n" + "\n".join(missing)
