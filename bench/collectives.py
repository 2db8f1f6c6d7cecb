"""The collectives of a CPU decode worker's TP group, timed both ways: gloo over loopback TCP, and the
shared-memory host group (services/engine/host_group.py) that the worker uses on the CPU instead.

`measure(ranks, ...)` spawns `ranks` processes joined by a gloo group over loopback, as a decode worker's
TP ranks are, and times on every rank an all-reduce of one decode step's activations ([rows, dim] fp32,
summed over all ranks) and an all-gather of the same tensor within groups of `gather_ranks` consecutive
ranks (what a DCP group gathers), each run `ops` times after a warm-up, gloo and host group interleaved
round by round. Reported per operation: the median over rounds of the slowest rank's mean time (a step
waits for its slowest rank), with min and max. Used by `pcpstack bench decode` (its `collectives` entry).
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pcpstack.common.ports import free_port
from pcpstack.engine.host_group import HostGroup, host_collectives_available

_SLOT_BYTES = 256 << 10


def _rank(rank: int, size: int, port: int, rows: int, dim: int, gather: int, ops: int, rounds: int, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=120))
    try:
        groups = [dist.new_group(list(range(g, g + gather))) for g in range(0, size, gather)]
        mine = groups[rank // gather]
        host = HostGroup.create(range(size), f"bench-{port}-all", _SLOT_BYTES, 60.0, dist.group.WORLD)
        host_gather = None
        for g, group in zip(range(0, size, gather), groups, strict=True):
            created = HostGroup.create(range(g, g + gather), f"bench-{port}-{g}", _SLOT_BYTES, 60.0, group)
            host_gather = created or host_gather
        x = torch.randn(rows, dim)
        ways = {
            "gloo_all_reduce": lambda: dist.all_reduce(x.clone()),
            "host_all_reduce": lambda: host.all_reduce_sum(x.clone()),
            "gloo_all_gather": lambda: dist.all_gather([torch.empty_like(x) for _ in range(gather)], x, mine),
            "host_all_gather": lambda: host_gather.all_gather(x),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for op in ways.values():  # warm-up
            for _ in range(5):
                op()
        for _ in range(rounds):
            for name, op in ways.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(ops):
                    op()
                times[name].append((time.perf_counter() - start) / ops)
        gathered = [None] * size if rank == 0 else None
        dist.gather_object(times, gathered, dst=0)
        if rank == 0:
            out.put(gathered)
    finally:
        dist.destroy_process_group()


def measure(
    ranks: int = 9, gather_ranks: int = 3, rows: int = 2, dim: int = 576, ops: int = 20, rounds: int = 5
) -> dict:
    """Per operation (gloo and host group, all-reduce over `ranks` and all-gather within `gather_ranks`):
    milliseconds, median over rounds of the slowest rank, with min and max; {} where the host group cannot
    run (not x86-64 Linux, or turned off)."""
    if not host_collectives_available() or ranks % gather_ranks:
        return {}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    args = (ranks, port, rows, dim, gather_ranks, ops, rounds, out)
    processes = [ctx.Process(target=_rank, args=(r, *args), daemon=True) for r in range(ranks)]
    for process in processes:
        process.start()
    try:
        per_rank = out.get(timeout=600)
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    result: dict = {"ranks": ranks, "gather_ranks": gather_ranks, "shape": [rows, dim], "ops": ops}
    for name in per_rank[0]:
        slowest = [max(times[name][i] for times in per_rank) * 1e3 for i in range(rounds)]
        result[f"{name}_ms"] = {
            "median": round(statistics.median(slowest), 3),
            "min": round(min(slowest), 3),
            "max": round(max(slowest), 3),
        }
    return result
