"""Limits the KV store keeps: block sizes a lookup can count, metadata and block keys inside the capacity,
and start-up flags it can serve with (a real store on 127.0.0.1 and real `pcpstack serve kvstore`
processes)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.errors import CapacityExceeded, InvalidArgument
from pcpstack.kvstore.main import add_arguments
from pcpstack.kvstore.store import (
    BLOCK_KEY_OVERHEAD_BYTES,
    DEFAULT_MAX_LEASE_MS,
    MAX_BLOCK_TOKENS,
)
from tests.common.test_startup import refusal
from tests.kvstore.conftest import running_store


@pytest.mark.timeout(30)
def test_block_tokens_a_lookup_could_not_count_are_refused_at_put():
    async def body():
        async with running_store() as server, KvStoreClient(server.address, prefer_shm=False) as client:
            with pytest.raises(InvalidArgument, match=rf"block_tokens must be in 1\.\.{MAX_BLOCK_TOKENS}"):
                await client.put("huge", "fp", b"kv", block_keys=["b0", "b1"], block_tokens=2**31)
            # The largest allowed still answers a lookup of every block in 32 bits.
            await client.put("largest", "fp", b"kv", block_keys=["b0", "b1"], block_tokens=MAX_BLOCK_TOKENS)
            found = await client.lookup(["b0", "b1"], "fp")
            assert (found.blocks, found.tokens) == (2, 2 * MAX_BLOCK_TOKENS)
            assert await client.release(found.lease_id, found.capability, lease=True)
            stat = await client.stat()
            assert (stat.refused_puts, stat.prefix_leases) == (1, 0)
            assert stat.max_lease_ms == DEFAULT_MAX_LEASE_MS  # what prefill checks a lease against
            assert stat.default_lease_ms == 60_000  # how long prefill keeps an answer pushed with lease 0

    asyncio.run(body())


@pytest.mark.timeout(30)
def test_metadata_and_block_keys_count_against_the_capacity():
    async def body():
        async with (
            running_store(capacity_bytes=1 << 20) as server,
            KvStoreClient(server.address, prefer_shm=False) as client,
        ):
            with pytest.raises(CapacityExceeded, match="payload, metadata and block keys"):
                await client.put("empty-but-huge", "fp", b"", metadata=b"m" * (2 << 20))
            keys = ["b0", "b1"]
            await client.put(
                "kv", "fp", b"x" * 1000, metadata=b"m" * (100 << 10), block_keys=keys, block_tokens=4
            )
            held = 1000 + (100 << 10) + sum(len(key) + BLOCK_KEY_OVERHEAD_BYTES for key in keys)
            stat = await client.stat()
            assert (stat.bytes, stat.pinned_bytes, stat.bytes_in, stat.refused_puts) == (held, held, 1000, 1)

    asyncio.run(body())


@pytest.mark.parametrize(
    ("service", "value", "rule"),
    [
        ("kvstore", "1000", "at least 2098176 for a store"),
        ("kvstore", str(1 << 20), "at least 2098176 for a store"),
        ("registry", "1000", "at least 65536"),
    ],
)
def test_a_max_message_bytes_too_small_to_serve_with_is_refused(
    child_env, service: str, value: str, rule: str
):
    line = refusal(child_env, service, "--port", "0", "--max-message-bytes", value)
    assert f"--max-message-bytes={value}: must be {rule}" in line


def test_a_default_lease_over_the_implicit_cap_is_refused_naming_the_flags(child_env):
    line = refusal(child_env, "kvstore", "--port", "0", "--default-lease-ms", "700000")
    assert "--default-lease-ms=700000 and --max-lease-ms=600000 (its default)" in line
    assert "default_lease_ms" not in line
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (max_lease,) = [action for action in parser._actions if "--max-lease-ms" in action.option_strings]
    assert f"default: {DEFAULT_MAX_LEASE_MS}" in max_lease.help
