"""Every RPC of every service gets hypothesis-generated messages (random field values, huge sizes, empty and
invalid ids, random KV bytes). Each answer must be a status a handler chose (never UNKNOWN/INTERNAL or a
hang), the service must still be SERVING and working afterwards, and the KV store must hold no leaked
reservations.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcpstack.common import security
from pcpstack.common.channel import open_channel
from pcpstack.kvstore.server import KvStoreServerConfig, serve
from pcpstack.registry.membership import Settings
from pcpstack.registry.server import start_registry
from pcpstack.v1 import (
    common_pb2,
    decode_pb2,
    kvstore_pb2,
    prefill_pb2,
    registry_pb2,
    registry_pb2_grpc,
)
from tests.fuzz.harness import LoopRunner, call, judge, serving
from tests.fuzz.messages import messages
from tests.helpers import start_stack

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    database=None,
)
# Addresses a fuzzed node may advertise: no random DNS names, nothing that reaches outside this host.
ADDRESSES = st.one_of(
    st.sampled_from(
        ["", "127.0.0.1:9000", "127.0.0.7:1", "localhost:65535", "[::1]:5", "h:1", "10.9.9.9:80"]
    ),
    st.sampled_from(["127.0.0.1:0", "127.0.0.1:99999", "0.0.0.0:1", ":1", "127.0.0.1:", "a" * 70_000 + ":1"]),
    st.text(alphabet=st.characters(codec="utf-8", blacklist_characters=":."), max_size=30),
)
HOSTS = st.sampled_from(["", "127.0.0.1", "127.0.0.9", "10.1.1.1", "::1", "0.0.0.0", "localhost", "x" * 300])


def _requests(descriptor, overrides=None, streaming: bool = False) -> st.SearchStrategy[list]:
    one = messages(descriptor, overrides)
    return st.lists(one, min_size=1, max_size=5 if streaming else 1)


def _fuzz_method(runner: LoopRunner, channel, method, overrides, examples: int) -> None:
    @settings(FUZZ, max_examples=examples)
    @given(requests=_requests(method.input_type, overrides, method.client_streaming))
    def fuzz(requests) -> None:
        code, details = runner.run(call(channel, method, requests))
        judge(method, code, details, requests)

    fuzz()


def _fuzz_service(runner: LoopRunner, address: str, service, overrides=None, examples: int = 40) -> None:
    """Fuzzes every method of service at address, then checks that it is still SERVING."""
    channel = runner.run(_open(address))
    try:
        for method in service.methods:
            _fuzz_method(runner, channel, method, overrides, examples)
        assert runner.run(serving(channel)), f"{service.full_name} stopped serving after fuzzing"
    finally:
        runner.run(channel.close())


async def _open(address: str) -> grpc.aio.Channel:
    return open_channel(address, default_deadline=30, security=security.PLAINTEXT)


@pytest.fixture
def runner() -> Iterator[LoopRunner]:
    loop_runner = LoopRunner()
    yield loop_runner
    loop_runner.close()


def test_fuzzed_registry_rpcs_get_chosen_statuses_and_it_keeps_serving(runner: LoopRunner) -> None:
    registry = runner.run(start_registry(Settings(lease_s=2.0, assembly_timeout_s=5.0, restore_grace_s=0.0)))
    try:
        overrides = {"RegisterRequest.address": ADDRESSES, "RegisterRequest.dist_host": HOSTS}
        _fuzz_service(
            runner, registry.address, registry_pb2.DESCRIPTOR.services_by_name["RegistryService"], overrides
        )

        async def still_registers() -> None:
            async with open_channel(
                registry.address, default_deadline=5, security=security.PLAINTEXT
            ) as channel:
                request = registry_pb2.RegisterRequest(
                    node_id="kv-after", role=common_pb2.NODE_ROLE_KVSTORE, address="127.0.0.1:9600"
                )
                await registry_pb2_grpc.RegistryServiceStub(channel).Register(request)

        runner.run(still_registers())
    finally:
        runner.run(registry.stop(grace=0))


def test_fuzzed_kvstore_rpcs_get_chosen_statuses_and_leak_no_reservation(
    runner: LoopRunner, tmp_path: Path
) -> None:
    store = runner.run(serve(KvStoreServerConfig(capacity_bytes=64 << 20, shm_dir=str(tmp_path))))
    try:
        _fuzz_service(
            runner, store.address, kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"], examples=60
        )

        async def stat() -> kvstore_pb2.StatResponse:
            async with open_channel(
                store.address, default_deadline=5, security=security.PLAINTEXT
            ) as channel:
                return await channel.unary_unary(
                    "/pcpstack.v1.KvStoreService/Stat",
                    request_serializer=kvstore_pb2.StatRequest.SerializeToString,
                    response_deserializer=kvstore_pb2.StatResponse.FromString,
                )(kvstore_pb2.StatRequest())

        assert runner.run(stat()).reserved_bytes == 0
    finally:
        runner.run(store.stop(grace=0))


def test_fuzzed_prefill_and_decode_rpcs_get_chosen_statuses_and_the_stack_still_generates(
    tmp_path: Path,
) -> None:
    from pcpstack.decode.client import DecodeClient, build_request
    from pcpstack.kvstore.client import KvStoreClient

    stack = start_stack(tmp_path, pcp=2, model="tiny")
    try:
        resolved = stack.run(_resolve(stack.stack.registry_address))
        prefill_address = resolved.prefill_sets[0].address
        kvstore = stack.stack.kvstore_address
        overrides = {
            # Prefill pushes KV wherever a request says: keep that to the stack's store or dead ends.
            "PrefillRequest.kvstore_address": st.sampled_from(
                ["", kvstore, "127.0.0.1:1", "nohost", "[::1]:x"]
            ),
            "SamplingParams.max_tokens": st.integers(0, 64) | st.sampled_from([2**32 - 1]),
        }
        _fuzz_service(
            stack, prefill_address, prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"], overrides, 25
        )
        _fuzz_service(
            stack, stack.decode, decode_pb2.DESCRIPTOR.services_by_name["DecodeService"], overrides, 25
        )

        async def generate_and_stat():
            client = DecodeClient(stack.decode)
            try:
                result = await client.generate(build_request("still alive", max_tokens=3, ignore_eos=True))
            finally:
                await client.close()
            async with KvStoreClient(kvstore) as store:
                return result, await store.stat()

        result, stat = stack.run(generate_and_stat())
        assert len(result.token_ids) == 3
        assert stat.reserved_bytes == 0
    finally:
        stack.stop()


async def _resolve(registry: str) -> registry_pb2.ResolveResponse:
    async with open_channel(registry, default_deadline=5, security=security.PLAINTEXT) as channel:
        return await registry_pb2_grpc.RegistryServiceStub(channel).Resolve(registry_pb2.ResolveRequest())
