"""Hypothesis strategies for any protobuf message, built from its descriptor.

Fields get random values of their type plus the values that break naive code: empty and huge strings,
invalid ids, boundary and out-of-range integers, NaN, unknown enum numbers, long repeated fields and random
bytes. `overrides` pins chosen fields ("Message.field") to a strategy of their own, e.g. addresses that
must not make a service dial the outside world.

One drawn message holds at most MAX_MESSAGE_BYTES of field values, nested messages included: a field whose
value would cross it stays unset. Without the cap, eight repeated messages three levels deep, each with
eight 1 MiB byte strings, make a rare draw of several GB in the test process itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

ODD_STRINGS = [
    "",
    " ",
    "x" * 100_000,
    "../../etc/passwd",
    "\x00",
    "id\nwith\nnewlines",
    "ü🙂",
    "a:b:c",
    "%s%n",
]
ODD_BYTES = [b"", b"\x00" * (1 << 20), b"\xff" * 7]
MAX_MESSAGE_BYTES = 16 << 20

_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({low, high, 0, 1, max(low, -1), min(high, 2**31 - 1), min(high, 1 << 20)})
    return st.one_of(
        st.sampled_from(edges), st.integers(max(low, -5), min(high, 5000)), st.integers(low, high)
    )


def scalar(field: FieldDescriptor) -> st.SearchStrategy:
    """Values for one (non-message) field."""
    cpp = field.cpp_type
    if cpp in _INT_RANGES:
        return _integers(*_INT_RANGES[cpp])
    if cpp == FieldDescriptor.CPPTYPE_BOOL:
        return st.booleans()
    if cpp == FieldDescriptor.CPPTYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if cpp == FieldDescriptor.CPPTYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if cpp == FieldDescriptor.CPPTYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-3, 1000))
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=4096), st.sampled_from(ODD_BYTES))
    return st.one_of(st.text(max_size=40), st.sampled_from(ODD_STRINGS))


class _Budget:
    """Bytes of field values one top-level message may still take (shared by its nested messages)."""

    def __init__(self) -> None:
        self.left = MAX_MESSAGE_BYTES

    def take(self, value) -> bool:
        cost = _cost(value)
        if cost > self.left:
            return False
        self.left -= cost
        return True


def _cost(value) -> int:
    """Roughly what value adds to a message: its encoded length for strings and bytes, 10 bytes per number
    (a varint's most)."""
    if isinstance(value, (list, tuple)):
        return sum(_cost(item) for item in value)
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes):
        return len(value)
    return 0 if value is None or hasattr(value, "ByteSize") else 10  # messages were charged as built


def messages(
    descriptor: Descriptor,
    overrides: Mapping[str, st.SearchStrategy] | None = None,
    depth: int = 3,
    budget: _Budget | None = None,
) -> st.SearchStrategy:
    """Messages of descriptor's type; each field is set or left unset at random, one member per oneof."""
    overrides = overrides or {}
    cls = message_factory.GetMessageClass(descriptor)
    top = budget is None
    budget = budget or _Budget()

    def value_of(field: FieldDescriptor) -> st.SearchStrategy:
        pinned = overrides.get(f"{descriptor.name}.{field.name}")
        if pinned is not None:
            return pinned
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if depth == 0:
                return st.just(None)
            return messages(field.message_type, overrides, depth - 1, budget)
        return scalar(field)

    def field_values(field: FieldDescriptor) -> st.SearchStrategy:
        if not field.is_repeated:
            return value_of(field)
        short = st.lists(value_of(field), max_size=8)
        if field.cpp_type in (FieldDescriptor.CPPTYPE_MESSAGE, FieldDescriptor.CPPTYPE_STRING):
            return short  # a huge list of huge strings would be a multi-GB message, not a test
        # A huge numeric field repeats one value: cheap to draw, as costly to serve as any other.
        return st.one_of(
            short, st.tuples(value_of(field), st.sampled_from([5000, 200_000])).map(lambda p: [p[0]] * p[1])
        )

    plain = [f for f in descriptor.fields if f.containing_oneof is None]
    oneofs = list(descriptor.oneofs)

    @st.composite
    def build(draw):
        if top:
            budget.left = MAX_MESSAGE_BYTES
        message = cls()
        chosen = [f for f in plain if draw(st.booleans())]
        for oneof in oneofs:
            member = draw(st.sampled_from([None, *oneof.fields]))
            if member is not None:
                chosen.append(member)
        for field in chosen:
            value = draw(field_values(field))
            if budget.take(value):
                _assign(message, field, value)
        return message

    return build()


def _assign(message, field: FieldDescriptor, value) -> None:
    target = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        # a map field: its drawn entries become keys (a later entry with the same key wins)
        message_values = (
            field.message_type.fields_by_name["value"].cpp_type == FieldDescriptor.CPPTYPE_MESSAGE
        )
        for entry in value:
            if entry is None:
                continue
            if message_values:
                target[entry.key].CopyFrom(entry.value)
            else:
                target[entry.key] = entry.value
    elif field.is_repeated:
        if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            for item in value:
                if item is not None:
                    target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
        if value is None:
            target.SetInParent()
        else:
            target.CopyFrom(value)
    else:
        setattr(message, field.name, value)
