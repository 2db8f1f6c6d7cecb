"""Load: 64 concurrent clients for PCPSTACK_LOAD_SECONDS (30 s by default) on a loopback stack of two PCP=2
sets and one decode worker (tiny model).

Every client loops greedy requests over varied prompts and compares each answer with a single run of the
same prompt made before the load. At the end: no errors, every answer correct, nothing pinned in the store,
and the resident memory of the decode, prefill (nodes with their ranks) and KV store process trees flat
after warm-up: the mean of the last third of the samples is within 10 % + 8 MiB of the mean of the first.
The store keeps released replicas as a cache until it needs room, so it runs with a 32 MiB capacity that
the test fills before the load: after that its memory must stay flat too.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import pytest

from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.kvstore.client import KvStoreClient
from tests.helpers import RunningStack
from tests.reliability.support import (
    generate,
    service,
    start_tuned_stack,
    tree_rss_bytes,
    wait_store_unpinned,
)

pytestmark = pytest.mark.slow

LOAD_SECONDS = float(os.environ.get("PCPSTACK_LOAD_SECONDS", "30"))
CLIENTS = 64
MAX_TOKENS = 8
PROMPTS = [[(17 * i + 5 * k + 1) % 256 for i in range(8 + 6 * k)] for k in range(32)]
WATCHED = ("decode-0", "prefill-0", "prefill-1", "kvstore")
MIB = 1024 * 1024
# The store keeps released replicas until it needs the room (LRU), so its memory grows to its capacity by
# design: the test fills it before the load, and after that any growth is a leak.
STORE_CAPACITY = 32 * MIB


@pytest.fixture
def stack(tmp_path) -> Iterator[RunningStack]:
    # The product's default 3 s lease: heartbeats compete with 64 clients for two shared cores.
    running = start_tuned_stack(
        tmp_path, pcp=2, prefill_sets=2, kv_capacity_bytes=STORE_CAPACITY, lease_s=3.0
    )
    yield running
    running.stop()


class RssSampler(threading.Thread):
    """Samples the resident memory of process trees once a second until stopped."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            self.samples.append((time.monotonic(), {n: tree_rss_bytes(p) for n, p in self.pids.items()}))


async def client_loop(address: str, index: int, until: float, expected: list[list[int]]) -> tuple[int, list]:
    """Requests until `until`; returns (answers, errors)."""
    client = DecodeClient(address)
    answers, errors = 0, []
    try:
        while time.monotonic() < until:
            k = (index + answers) % len(PROMPTS)
            request = build_request(PROMPTS[k], max_tokens=MAX_TOKENS, ignore_eos=True)
            try:
                got = await asyncio.wait_for(client.generate(request, timeout=60), 70)
            except Exception as exc:
                errors.append(f"client {index} prompt {k}: {type(exc).__name__}: {exc}")
                continue
            if got.token_ids != expected[k]:
                errors.append(f"client {index} prompt {k}: {got.token_ids} != {expected[k]}")
            answers += 1
    finally:
        await client.close()
    return answers, errors


async def fill_store(address: str, capacity: int) -> None:
    """Fills the store to its capacity with released objects, as a long-running store is: with prefix reuse
    most requests add only a few blocks, and 30 s of load would not reach the capacity on their own."""
    async with KvStoreClient(address) as store:
        for i in range(capacity // MIB):
            stored = await store.put(f"load-test-filler-{i}", "filler", bytes(MIB))
            await store.release(stored.key, stored.capability)


def test_64_clients_get_correct_answers_with_nothing_pinned_and_flat_memory(stack) -> None:
    expected = [stack.run(generate(stack.decode, p, max_tokens=MAX_TOKENS)).token_ids for p in PROMPTS]
    stack.run(fill_store(stack.stack.kvstore_address, STORE_CAPACITY))
    sampler = RssSampler({name: service(stack, name).process.pid for name in WATCHED})
    started = time.monotonic()
    sampler.start()

    async def load():
        until = time.monotonic() + LOAD_SECONDS
        loops = [client_loop(stack.decode, i, until, expected) for i in range(CLIENTS)]
        return await asyncio.wait_for(asyncio.gather(*loops), LOAD_SECONDS + 120)

    try:
        results = stack.run(load())
    finally:
        sampler.stopped.set()
        sampler.join()
    elapsed = time.monotonic() - started
    answers = sum(r[0] for r in results)
    errors = [e for r in results for e in r[1]]
    assert errors == [], f"{len(errors)} errors, first: {errors[:5]}"
    assert answers >= CLIENTS
    stat = wait_store_unpinned(stack)
    assert stat.bytes <= STORE_CAPACITY

    warm = [s for t, s in sampler.samples if t - started >= LOAD_SECONDS / 4]
    assert len(warm) >= 6, f"only {len(warm)} memory samples after warm-up"
    third = len(warm) // 3
    report = [f"{answers} answers in {elapsed:.0f} s ({answers / elapsed:.1f}/s)"]
    growth = {}
    for name in WATCHED:
        first = sum(s[name] for s in warm[:third]) / third
        last = sum(s[name] for s in warm[-third:]) / third
        report.append(f"{name}: {first / MIB:.0f} -> {last / MIB:.0f} MiB")
        if last > first * 1.10 + 8 * MIB:
            growth[name] = (first / MIB, last / MIB)
    print("; ".join(report))
    assert growth == {}, f"resident memory grew after warm-up (MiB, first third -> last third): {growth}"
