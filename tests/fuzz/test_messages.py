"""The message strategy's size cap: no drawn message outgrows MAX_MESSAGE_BYTES by more than its framing,
however deep and repeated its fields, so a fuzz run never builds GB-size messages in the test process."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcpstack.v1 import decode_pb2, kvstore_pb2, prefill_pb2, registry_pb2
from tests.fuzz.messages import MAX_MESSAGE_BYTES, messages

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# field tags and length prefixes come on top of the values the cap counts
FRAMED_CAP = MAX_MESSAGE_BYTES * 1.25
REQUEST_TYPES = sorted(
    {
        method.input_type
        for module in (decode_pb2, kvstore_pb2, prefill_pb2, registry_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    },
    key=lambda descriptor: descriptor.full_name,
)


def _nested_blobs():
    """Top { repeated Mid mids; } Mid { repeated Leaf leaves; } Leaf { repeated bytes blobs; }: with every
    blob 1 MiB, an uncapped draw is up to 8 x 8 x 8 MiB."""
    proto = descriptor_pb2.FileDescriptorProto(name="fuzz_cap_test.proto", package="fuzzcap", syntax="proto3")
    for name, field, kind, type_name in (
        ("Leaf", "blobs", descriptor_pb2.FieldDescriptorProto.TYPE_BYTES, None),
        ("Mid", "leaves", descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, ".fuzzcap.Leaf"),
        ("Top", "mids", descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, ".fuzzcap.Mid"),
    ):
        message = proto.message_type.add(name=name)
        message.field.add(
            name=field, number=1, type=kind, label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
        )
        if type_name:
            message.field[0].type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool.FindMessageTypeByName("fuzzcap.Top")


def test_deeply_repeated_megabyte_blobs_stay_within_the_cap() -> None:
    strategy = messages(_nested_blobs(), {"Leaf.blobs": st.just(b"\x00" * (1 << 20))})
    sizes = []

    @SETTINGS
    @given(strategy)
    def draw(message) -> None:
        sizes.append(message.ByteSize())
        assert sizes[-1] <= FRAMED_CAP, f"{sizes[-1]} bytes"

    draw()
    assert max(sizes) > MAX_MESSAGE_BYTES // 2, "the draws never came near the cap: the test shows nothing"


@pytest.mark.parametrize("descriptor", REQUEST_TYPES, ids=lambda descriptor: descriptor.name)
def test_a_drawn_request_stays_within_the_cap(descriptor) -> None:
    @SETTINGS
    @given(messages(descriptor))
    def draw(message) -> None:
        assert message.ByteSize() <= FRAMED_CAP, f"{descriptor.name}: {message.ByteSize()} bytes"

    draw()
