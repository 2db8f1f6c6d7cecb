"""Each running service's reflection lists exactly the methods its proto declares."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2

from pcpstack.common.channel import open_channel
from pcpstack.v1 import decode_pb2, kvstore_pb2, prefill_pb2, registry_pb2
from tests.helpers import start_stack

EXPECTED = {
    "registry": registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
    "kvstore": kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"],
    "prefill-0": prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"],
    "decode-0": decode_pb2.DESCRIPTOR.services_by_name["DecodeService"],
}


async def reflected_methods(address: str, service: str) -> tuple[set[str], set[str]]:
    """(services listed, methods of `service`) as the server's reflection reports them."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with open_channel(address, default_deadline=10) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=service),
        ]
        replies = [reply async for reply in stub.ServerReflectionInfo(iter(requests))]
    listed = {s.name for s in replies[0].list_services_response.service}
    methods = set()
    for blob in replies[1].file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto.FromString(blob)
        for svc in proto.service:
            if f"{proto.package}.{svc.name}" == service:
                methods |= {m.name for m in svc.method}
    return listed, methods


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(tmp_path_factory.mktemp("reflection"), pcp=1, model="tiny")
    yield running
    running.stop()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reflection_lists_exactly_the_proto_methods(stack, name) -> None:
    service = EXPECTED[name]
    address = next(s.address for s in stack.stack.services if s.name == name)
    listed, methods = stack.run(reflected_methods(address, service.full_name))
    assert service.full_name in listed
    assert "grpc.health.v1.Health" in listed
    assert methods == {m.name for m in service.methods}
