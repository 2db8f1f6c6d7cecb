"""Processes killed with SIGKILL leave nothing behind: a writer midway through a put (both paths), and a
store whose segments the next store reclaims."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pcpstack.cli.launch import spawn_and_wait_listening
from pcpstack.common.errors import Unavailable
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.shm import SegmentStore
from tests.kvstore.conftest import running_store, segment_files

# Speaks the real protocol up to the middle of a put, says READY, then waits to be killed.
_HALF_A_PUT = textwrap.dedent(
    """
    import asyncio, mmap, os, sys
    import grpc
    from pcpstack.kvstore.checksum import crc32c
    from pcpstack.v1 import kvstore_pb2 as pb, kvstore_pb2_grpc

    async def main(address, mode, shm_dir):
        size = 8 << 20
        call = kvstore_pb2_grpc.KvStoreServiceStub(grpc.aio.insecure_channel(address)).Put()
        header = pb.PutHeader(key="victim", fingerprint="fp", total_bytes=size, chunk_size=1 << 20,
                              use_shm=mode == "shm")
        await call.write(pb.PutRequest(header=header))
        accepted = (await call.read()).accepted
        if mode == "shm":
            fd = os.open(os.path.join(shm_dir, accepted.shm_name), os.O_RDWR)
            segment = mmap.mmap(fd, size)
            segment[: size // 2] = b"x" * (size // 2)
        else:
            data = b"x" * (1 << 20)
            for i in range(3):
                chunk = pb.PutChunk(offset=i << 20, data=data, crc32c=crc32c(data))
                await call.write(pb.PutRequest(chunk=chunk))
        print("READY", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.mark.parametrize("mode", ["grpc", "shm"])
@pytest.mark.timeout(60)
def test_writer_killed_midway_leaves_no_object_reservation_or_segment(mode: str, child_env):
    async def body():
        # No standby segments: the pool's contents are what this test checks.
        store = running_store(capacity_bytes=64 << 20, standby_min_bytes=0)
        async with store as server, KvStoreClient(server.address) as client:
            shm_dir = (await client.stat()).shm_dir
            writer = subprocess.Popen(
                [sys.executable, "-c", _HALF_A_PUT, server.address, mode, shm_dir],
                stdout=subprocess.PIPE,
                env=child_env,
            )
            try:
                line = await asyncio.to_thread(writer.stdout.readline)
                assert line.strip() == b"READY"
                assert (await client.stat()).reserved_bytes == 8 << 20
            finally:
                writer.send_signal(signal.SIGKILL)
                writer.wait()
            for _ in range(200):
                stats = await client.stat()
                if stats.aborted_puts:
                    break
                await asyncio.sleep(0.05)
            assert (stats.aborted_puts, stats.objects, stats.reserved_bytes, stats.bytes) == (1, 0, 0, 0)
            # The segment went back to the warm pool, inside the budget, and is reused by the next put.
            assert stats.pooled_bytes == 8 << 20
            pooled = segment_files(server)
            await client.put("next", "fp", bytes(8 << 20))
            assert segment_files(server) == pooled and (await client.stat()).pooled_bytes == 0

    asyncio.run(body())


@pytest.mark.timeout(60)
def test_segments_of_a_killed_store_are_reclaimed_by_the_next_store(child_env):
    store, address = spawn_and_wait_listening("kvstore", ["--port", "0"], env=child_env)
    try:

        async def fill() -> str:
            async with KvStoreClient(address) as client:
                await client.put("k", "fp", bytes(1 << 20))
                stat = await client.stat()
                return os.path.join(stat.shm_dir, stat.shm_probe)

        probe = asyncio.run(fill())
    finally:
        store.send_signal(signal.SIGKILL)
        store.wait()
    token = os.path.basename(probe).removeprefix("pcpkv-").removesuffix(".lock")
    shm_dir = os.path.dirname(probe)
    assert [name for name in os.listdir(shm_dir) if token in name]
    successor = SegmentStore(shm_dir)
    try:
        assert successor.reclaimed_orphans >= 1
        assert not [name for name in os.listdir(shm_dir) if token in name]
    finally:
        successor.close()


@pytest.mark.timeout(60)
def test_an_announcement_to_a_frozen_store_gives_up_after_its_timeout_and_the_put_still_works(child_env):
    """A prefill rank announces its push before its forward, while its set's other ranks wait: a store that
    does not answer (SIGSTOP) must cost it the announcement's timeout, not the client's 60 s deadline."""
    store, address = spawn_and_wait_listening("kvstore", ["--port", "0"], env=child_env)
    try:

        async def body() -> None:
            async with KvStoreClient(address) as client:
                assert await client.uses_shm()  # the store's standby size is known from here on
                store.send_signal(signal.SIGSTOP)
                try:
                    started = asyncio.get_running_loop().time()
                    assert await client.prepare_put(16 << 20, timeout_s=0.5) == ""
                    assert asyncio.get_running_loop().time() - started < 5
                finally:
                    store.send_signal(signal.SIGCONT)
                stored = await client.put("after", "fp", bytes(16 << 20))
                data, _ = await client.get("after", "fp", stored.capability)
                assert data.nbytes == 16 << 20

        asyncio.run(body())
    finally:
        store.send_signal(signal.SIGKILL)
        store.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefer_shm", [False, True], ids=["grpc", "shm"])
def test_a_frozen_store_fails_a_put_and_a_get_unavailable_after_the_stall_bound_then_serves(
    prefer_shm: bool, child_env
):
    """A store stopped (SIGSTOP) mid-service keeps its connections open and answers nothing: every call
    would wait out the client's 60 s deadline, and a prefill set's requests with it. Each step of a call
    waits at most stall_s; the call fails Unavailable naming the store, and the same client works once the
    store runs again."""
    store, address = spawn_and_wait_listening("kvstore", ["--port", "0"], env=child_env)
    try:

        async def body() -> None:
            async with KvStoreClient(address, prefer_shm=prefer_shm, stall_s=1.0) as client:
                assert await client.uses_shm() == prefer_shm
                stored = await client.put("before", "fp", bytes(16 << 20))
                store.send_signal(signal.SIGSTOP)
                try:
                    for name, call in (
                        ("put", client.put("frozen", "fp", bytes(16 << 20))),
                        ("get", client.get("before", "fp", stored.capability)),
                        ("stat", client.stat()),
                    ):
                        started = asyncio.get_running_loop().time()
                        with pytest.raises(
                            Unavailable, match=f"KV store at {address} did not answer within 1 s"
                        ):
                            await call
                        assert asyncio.get_running_loop().time() - started < 10, name
                finally:
                    store.send_signal(signal.SIGCONT)
                data, _ = await client.get("before", "fp", stored.capability)
                assert data.nbytes == 16 << 20
                await client.put("after", "fp", bytes(16 << 20))

        asyncio.run(body())
    finally:
        store.send_signal(signal.SIGKILL)
        store.wait()
