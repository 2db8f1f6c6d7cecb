"""The store as a real process: its flags reach the store it serves."""

from __future__ import annotations

import asyncio
import signal

import pytest

from pcpstack.cli.launch import spawn_and_wait_listening
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.errors import InvalidArgument

LEASE_FLAGS = ["--default-lease-ms", "500", "--max-lease-ms", "1000"]


@pytest.mark.timeout(60)
def test_max_lease_flag_caps_the_lease_a_writer_may_ask_for(child_env):
    store, address = spawn_and_wait_listening("kvstore", ["--port", "0", *LEASE_FLAGS], env=child_env)
    try:

        async def body() -> None:
            async with KvStoreClient(address) as client:
                with pytest.raises(InvalidArgument, match="cap of 1000 ms"):
                    await client.put("k", "fp", b"abcd", lease_ms=2**32 - 1)
                assert (await client.put("k", "fp", b"abcd", lease_ms=1000)).total_bytes == 4

        asyncio.run(body())
    finally:
        store.send_signal(signal.SIGTERM)
        store.wait(timeout=30)
