"""Every RPC the protos declare is either protected by the token (security.PROTECTED_METHODS) or named here as
open, with the reason it may be: a new RPC that changes what a service holds cannot be added unguarded."""

from __future__ import annotations

from pcpstack.common.security import PROTECTED_METHODS
from pcpstack.v1 import decode_pb2, kvstore_pb2, prefill_pb2, registry_pb2

# Reads that change nothing: open to whoever reaches the port, as health and reflection are.
OPEN = {
    # The object's capability, a bearer secret the writer hands only to its reader, guards it.
    "/pcpstack.v1.KvStoreService/Get",
    # Gauges and counters; an object's details need its capability.
    "/pcpstack.v1.KvStoreService/Stat",
    # Routing: which sets and nodes are ready, and where.
    "/pcpstack.v1.RegistryService/Resolve",
    "/pcpstack.v1.RegistryService/ListNodes",
    "/pcpstack.v1.RegistryService/ListSets",
}


def declared_methods() -> set[str]:
    methods = set()
    for module in (decode_pb2, kvstore_pb2, prefill_pb2, registry_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            methods |= {f"/{service.full_name}/{method.name}" for method in service.methods}
    return methods


def test_every_rpc_is_protected_or_named_open() -> None:
    declared = declared_methods()
    assert not PROTECTED_METHODS & OPEN
    assert declared - PROTECTED_METHODS - OPEN == set(), "RPCs neither protected nor named open"
    assert (PROTECTED_METHODS | OPEN) - declared == set(), "names of RPCs the protos do not declare"
    assert "/pcpstack.v1.PrefillService/Abandon" in PROTECTED_METHODS  # it deletes store objects
