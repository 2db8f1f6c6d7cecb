"""KV read capabilities through real processes: registry, KV store, a PCP=2 prefill node and a decode
worker on the tiny model.

The prefill set's answer carries the store's capability in its KvHandle; a peer without it can neither
read, release nor describe the replica; decode presents it, so a whole request completes and leaves
nothing pinned; the capability is never written to any service's log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.errors import CapabilityDenied
from pcpstack.prefill.client import PrefillClient
from pcpstack.v1 import common_pb2
from tests.helpers import start_stack
from tests.reliability.support import generate, wait_store_unpinned

GREEDY = common_pb2.SamplingParams(max_tokens=1, temperature=0)
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("capability-stack")
    running = start_stack(log_dir, pcp=2, decode=1, model="tiny", kv_capacity_bytes=1 << 20)
    running.log_dir = log_dir
    yield running
    running.stop()


def _prefill_address(stack) -> str:
    return next(s.address for s in stack.stack.services if s.name == "prefill-0")


async def _prefill(stack, request_id: str) -> common_pb2.KvHandle:
    client = PrefillClient(_prefill_address(stack))
    try:
        return (await client.prefill(request_id, PROMPT, GREEDY, timeout=60)).kv
    finally:
        await client.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replica_opens_only_with_the_capability_in_the_prefill_answer(stack):
    async def body() -> common_pb2.KvHandle:
        handle = await _prefill(stack, "capability-1")
        assert len(handle.capability) >= 32
        async with KvStoreClient(handle.store_address) as peer:
            for presented in ("", "forged-token"):
                with pytest.raises(CapabilityDenied, match=handle.key):
                    await peer.get(handle.key, handle.fingerprint, presented)
                with pytest.raises(CapabilityDenied, match=handle.key):
                    await peer.release(handle.key, presented)
                assert not (await peer.stat(handle.key, presented)).HasField("object")
            assert (await peer.stat(handle.key, handle.capability)).object.pinned
            data, _ = await peer.get(handle.key, handle.fingerprint, handle.capability)
            assert len(data) == handle.total_bytes
            assert await peer.release(handle.key, handle.capability) is True
        return handle

    handle = stack.run(body())
    logs = [path.read_text(errors="replace") for path in Path(stack.log_dir).rglob("*.log")]
    assert logs and not [text for text in logs if handle.capability in text]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_decode_presents_the_capability_and_releases_the_replica(stack):
    answer = stack.run(asyncio.wait_for(generate(stack.decode, PROMPT, max_tokens=4), 120))
    assert len(answer.token_ids) == 4
    stat = wait_store_unpinned(stack)
    assert (stat.pinned_bytes, stat.repeated_releases, stat.lease_expiries) == (0, 0, 0)
