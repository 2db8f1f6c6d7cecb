"""A transfer cancelled while a thread still copies through a shared-memory segment: nobody hands the
segment back before that thread ends, so the store never shrinks it under a client's copy (SIGBUS) nor
resizes it under its own checksum (BufferError), and no segment ever drops out of the pool un-unlinked.

To land the cancellation inside the copy every time, these tests hold the copying thread, its segment
mapped, until the rest of the scenario has run; the copy itself, the store and gRPC are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
import threading

import pytest

from pcpstack.kvstore import shm
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.shm import SegmentStore
from tests.kvstore.conftest import running_store

BIG, SMALL = 256 << 20, 32 << 20  # SMALL lands in BIG's freed segment shrunk: over a quarter smaller

# A client whose get (or put) of BIG bytes is cancelled while its copy thread, held at its start, has the
# store's segment mapped (kept from an earlier transfer, as clients keep them). Meanwhile the object is
# freed and a put of SMALL bytes could take its segment, shrunk; then the copy goes on. A segment handed
# back too early kills this process with SIGBUS; otherwise it prints SURVIVED.
_CANCELLED_COPY = textwrap.dedent(
    """
    import asyncio, contextlib, sys, threading
    from pcpstack.kvstore.client import KvStoreClient

    BIG, SMALL = int(sys.argv[3]), int(sys.argv[4])

    def held(maps, method):
        started, go_on, finished = threading.Event(), threading.Event(), threading.Event()
        copy = getattr(maps, method)

        def copy_when_let_go(*args):
            started.set()
            go_on.wait(30)
            try:
                return copy(*args)
            finally:
                finished.set()

        setattr(maps, method, copy_when_let_go)
        return started, go_on, finished

    async def segment_handed_back(client):
        for _ in range(50):  # the store gets a half-close or cancel within milliseconds
            if (await client.stat()).pooled_bytes >= BIG:
                return True
            await asyncio.sleep(0.02)
        return False

    async def main(address, mode):
        data = bytes(BIG)
        async with KvStoreClient(address) as writer, KvStoreClient(address) as other:
            assert await writer.uses_shm() and await other.uses_shm()
            if mode == "get":
                stored = await writer.put("big", "fp", data)
                await other.get("big", "fp", stored.capability)  # maps the segment, kept
                started, go_on, finished = held(other._segments, "copy_out")
                transfer = asyncio.create_task(other.get("big", "fp", stored.capability))
                await asyncio.to_thread(started.wait, 30)
                await writer.delete("big", stored.capability)  # freed once its reader lets go
            else:
                stored = await writer.put("warm", "fp", data)  # maps the segment, kept
                await writer.delete("warm", stored.capability)
                started, go_on, finished = held(writer._segments, "fill")
                transfer = asyncio.create_task(writer.put("big", "fp", data))  # into the same segment
                await asyncio.to_thread(started.wait, 30)
            transfer.cancel()
            print("handed back while copying:", await segment_handed_back(other), flush=True)
            await other.put("small", "fp", bytes(SMALL))
            go_on.set()
            with contextlib.suppress(asyncio.CancelledError):
                await transfer
            await asyncio.to_thread(finished.wait, 30)
            print("SURVIVED", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def _run_cancelled_copy(mode: str, env: dict[str, str]) -> tuple[int, str]:
    """Runs _CANCELLED_COPY against a store of this process; its exit status and output."""
    async with running_store(capacity_bytes=4 * BIG, standby_min_bytes=0) as server:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CANCELLED_COPY,
            server.address,
            mode,
            str(BIG),
            str(SMALL),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
        output, _ = await child.communicate()
    return child.returncode, output.decode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["get", "put"])
def test_a_shm_transfer_cancelled_midcopy_keeps_its_segment_until_the_copy_ends(mode: str, child_env):
    returncode, output = asyncio.run(_run_cancelled_copy(mode, child_env))
    assert returncode == 0, f"the client died (exit status {returncode}): {output}"
    assert "handed back while copying: False" in output and "SURVIVED" in output, output


@pytest.mark.timeout(60)
def test_a_put_cancelled_during_the_stores_checksum_leaves_a_reusable_segment_and_no_file(monkeypatch):
    crc_started, crc_go_on = threading.Event(), threading.Event()
    checksum = shm.crc32c_two_threads

    def checksum_when_let_go(view: memoryview) -> int:
        if not crc_started.is_set():  # the first put's checksum only, held with the segment's view taken
            crc_started.set()
            crc_go_on.wait(30)
        return checksum(view)

    monkeypatch.setattr(shm, "crc32c_two_threads", checksum_when_let_go)

    async def body():
        async with running_store(capacity_bytes=4 * BIG, standby_min_bytes=0) as server:
            async with KvStoreClient(server.address) as writer, KvStoreClient(server.address) as other:
                assert await writer.uses_shm()
                put = asyncio.create_task(writer.put("a", "fp", bytes(BIG)))
                await asyncio.to_thread(crc_started.wait, 30)
                put.cancel()  # the writer goes away while the store checksums its segment
                with contextlib.suppress(asyncio.CancelledError):
                    await put
                await asyncio.sleep(0.2)  # the store sees the cancellation (it used to pool the segment then)
                try:
                    # A put of another size takes a segment the checksum does not hold.
                    small = await other.put("b", "fp", bytes(SMALL))
                finally:
                    crc_go_on.set()
                for _ in range(100):
                    if (stats := await other.stat()).aborted_puts:
                        break
                    await asyncio.sleep(0.02)
                assert (stats.aborted_puts, stats.refused_puts, stats.pooled_bytes) == (1, 0, BIG)
                # The aborted put's segment, now free, is resized for a third size and read back.
                payload = bytes(range(256)) * (SMALL // 128)
                third = await other.put("c", "fp", payload)
                data, _ = await other.get("c", "fp", third.capability)
                assert bytes(data) == payload
                assert small.total_bytes == SMALL and (await other.stat()).pooled_bytes == 0
            segments = server.servicer.segments
        assert not list(segments.directory.glob(f"pcpkv-{segments.token}*"))

    asyncio.run(body())


def test_a_segment_in_use_that_cannot_be_resized_or_unmapped_is_still_unlinked(tmp_path):
    segments = SegmentStore(tmp_path)
    try:
        busy = segments.allocate(4 << 20)
        segments.recycle(busy)
        with busy.view(0, 4 << 20) as view:  # a thread still reading it
            with pytest.raises(BufferError):
                segments.allocate(1 << 20)  # would shrink it: refused, and the segment is unlinked
            assert not busy.path.exists() and segments.pooled_bytes == 0
            view[:5] = b"alive"  # the mapping stays until its last view goes
        other = segments.allocate(2 << 20)
        segments.recycle(other)
        with other.view(0, 2 << 20):
            segments.trim(0)  # unlinks it even though it cannot be unmapped yet
        assert not other.path.exists() and segments.pooled_bytes == 0
    finally:
        segments.close()
    assert not list(tmp_path.iterdir())
