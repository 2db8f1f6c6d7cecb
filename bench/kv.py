"""`pcpstack bench kv`: put and get throughput of the KV store, over gRPC streaming and shared memory.

The store runs in its own process (as in production), started with `pcpstack serve kvstore --port 0`;
the client runs here. Each repeat puts a fresh object, reads it back (checksums verified), then deletes
it, so later repeats measure the steady state: the store's warm segment pool, and on the client its kept
mappings of those segments and the receive buffer the previous get left behind. A first, untimed round
warms both processes' memory (on this VM the first touch of fresh memory costs up to 3x); it is reported
apart as `first_*`. Reports medians of the timed repeats, and the CPU time each side spent: the client's
(all its threads) per put and get, and the store's per put and per object, the latter all its work for
one object from the announcement on: a standby's pages included, which are readied between puts (its
process's clock ticks, 10 ms each, summed over the timed repeats and averaged). On a busy machine wall times
swing widely; CPU times hold.

Path `shm_full` is the shared-memory path as a serving store sees it after a while: full of replicas kept
for prefix reuse. Each put is released after its get instead of deleted, so from the ninth put on (the store
holds eight objects) every put needs the room of the least recently used one, and the store's standby
segment (shm.SegmentStore.standby) is what keeps the put in warm pages. Puts of objects that get a standby
are 0.5 s apart there (off the clock), as a prefill rank's pushes are seconds apart: the standby is
prepared between them. Path `shm_mixed` is the same store with objects of many sizes (a quarter of
--bytes to all of it, in a seeded order, each unlike the last): each put is announced first
(KvStoreClient.prepare_put), as a prefill rank announces its push when its forward starts, then follows
0.5 s later; rates are per put, of its own size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import subprocess
import time

from bench.machine import machine_facts, process_cpu_s
from pcpstack.cli.launch import spawn_and_wait_listening
from pcpstack.common.tunables import ensure_glibc_tunables
from pcpstack.kvstore.server import STANDBY_MIN_BYTES
from pcpstack.kvstore.stream import DEFAULT_CHUNK_BYTES

PATHS = ("grpc", "shm", "shm_full", "shm_mixed")
FULL_STORE_PATHS = ("shm_full", "shm_mixed")
# Off the clock before each put of the full-store paths (shm_full: objects that get a standby; shm_mixed:
# after its announcement): a prefill rank's pushes are seconds apart, the store readies standbys meanwhile.
KEPT_PAUSE_S = 0.5
_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def parse_size(text: str) -> int:
    """'256MiB' -> 268435456; accepts B, KiB, MiB, GiB, KB, MB, GB or a plain number."""
    number = text.rstrip("BbIiKkMmGg")
    try:
        return int(float(number) * _UNITS[text[len(number) :].upper()])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 256MiB") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options."""
    parser.add_argument("--bytes", type=parse_size, default=256 << 20, help="object size (e.g. 256MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="puts and gets per path")
    parser.add_argument(
        "--chunk-bytes", type=parse_size, default=DEFAULT_CHUNK_BYTES, help="chunk size on the gRPC path"
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=list(PATHS),
        help="transfer paths to measure (default: all; each shm path takes seconds, gRPC tens of seconds)",
    )


def _start_store(capacity: int) -> tuple[subprocess.Popen, str]:
    return spawn_and_wait_listening("kvstore", ["--port", "0", "--capacity-bytes", str(capacity)])


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(
    address: str, store_pid: int, path: str, size: int, repeats: int, chunk: int, kept_from: int
) -> dict:
    """Puts, reads back and drops `repeats + 1` objects over one path (the first untimed). On the full-store
    paths the objects are released, not deleted, and the timed puts begin once the store is full (kept_from
    puts in: `repeats + 1` timed ones after that many untimed); shm_mixed's sizes vary, each announced."""
    from pcpstack.kvstore.client import KvStoreClient

    prefer_shm, keep, announce = path != "grpc", path in FULL_STORE_PATHS, path == "shm_mixed"
    count = (kept_from if keep else 0) + repeats + 1
    sizes = _mixed_sizes(size, count) if announce else [size] * count
    payload = memoryview(os.urandom(size))
    puts, gets, put_cpu, get_cpu, store_put_cpu, store_cpu_each = [], [], [], [], [], []
    async with KvStoreClient(address, prefer_shm=prefer_shm, chunk_bytes=chunk) as client:
        if await client.uses_shm() != prefer_shm:
            raise RuntimeError(f"client could not take the {'shm' if prefer_shm else 'gRPC'} path")
        for i, n in enumerate(sizes):
            key = f"bench-{path}-{i}"
            store_cycle = process_cpu_s(store_pid)
            if announce:  # as a prefill rank does when its forward starts; the pause stands for the forward
                await client.prepare_put(n)
                await asyncio.sleep(KEPT_PAUSE_S)
            store_cpu, cpu, start = process_cpu_s(store_pid), _own_cpu_s(), time.perf_counter()
            capability = (await client.put(key, "bench", payload[:n])).capability
            puts.append(time.perf_counter() - start)
            put_cpu.append(_own_cpu_s() - cpu)
            store_put_cpu.append(process_cpu_s(store_pid) - store_cpu)
            cpu, start = _own_cpu_s(), time.perf_counter()
            data, _ = await client.get(key, "bench", capability)
            gets.append(time.perf_counter() - start)
            get_cpu.append(_own_cpu_s() - cpu)
            if data.nbytes != n:
                raise RuntimeError(f"read back {data.nbytes} bytes of {n}")
            del data
            if not keep:
                await client.delete(key, capability)
            else:
                await client.release(key, capability)
                if not announce and size >= STANDBY_MIN_BYTES:
                    await asyncio.sleep(KEPT_PAUSE_S)
            store_cpu_each.append(process_cpu_s(store_pid) - store_cycle)
    if keep:  # the puts that filled the store are not the steady state
        for kept in (sizes, puts, gets, put_cpu, get_cpu, store_put_cpu, store_cpu_each):
            del kept[:kept_from]
    put_rates = [n / t / 1e6 for n, t in zip(sizes, puts, strict=True)]
    get_rates = [n / t / 1e6 for n, t in zip(sizes, gets, strict=True)]
    (first_put, *put_rates), (first_get, *get_rates) = put_rates, get_rates
    return {
        "put_mb_s": round(statistics.median(put_rates), 1),
        "get_mb_s": round(statistics.median(get_rates), 1),
        "put_mb_s_all": [round(rate, 1) for rate in put_rates],
        "get_mb_s_all": [round(rate, 1) for rate in get_rates],
        "first_put_mb_s": round(first_put, 1),
        "first_get_mb_s": round(first_get, 1),
        "put_client_cpu_ms": round(statistics.median(put_cpu[1:]) * 1e3, 1),
        "put_store_cpu_ms": round(statistics.mean(store_put_cpu[1:]) * 1e3, 1),
        # All the store's work for one object: its announcement and standby, put, get, release or delete.
        "store_cpu_per_object_ms": round(statistics.mean(store_cpu_each[1:]) * 1e3, 1),
        "get_client_cpu_ms": round(statistics.median(get_cpu[1:]) * 1e3, 1),
        **({"sizes": sizes} if announce else {}),
    }


def _mixed_sizes(size: int, count: int) -> list[int]:
    """count object sizes between a quarter of size and size, seeded: small and large ones in turn (a
    quarter to a half of size, then 70 % to all of it), so each is unlike the one before it by more than
    a standby's slack (a quarter): prompts of many lengths. In 4 KiB steps from 64 KiB up."""
    rng, step = random.Random(0), 4096 if size >= 64 << 10 else 1
    spans = ((size // 4, size // 2), (size * 7 // 10, size))
    return [max(1, rng.randint(*spans[i % 2]) // step * step) for i in range(count)]


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark and returns its results."""
    ensure_glibc_tunables()
    facts = machine_facts()  # before the store starts: the load average says how busy the machine already was
    # Twice the mappings a client keeps (shm.SegmentMaps): on shm_full, the segment an eviction frees was
    # written so long ago that the writer no longer has it mapped, as in a store of a serving stack.
    objects = 8
    proc, address = _start_store(capacity=objects * args.bytes)
    try:
        results = {
            **facts,
            "bytes": args.bytes,
            "repeats": args.repeats,
            "chunk_bytes": args.chunk_bytes,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        }
        for name in args.paths:
            results[name] = asyncio.run(
                _measure(address, proc.pid, name, args.bytes, args.repeats, args.chunk_bytes, objects)
            )
        return results
    finally:
        proc.terminate()
        proc.wait(10)
