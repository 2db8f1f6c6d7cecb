"""`pcpstack bench prefill`: time to first token of context-parallel prefill, PCP=1 against PCP>1, and of
tensor parallelism inside each PCP rank (`--tp 1,3`: every TP x PCP pair).

Each configuration runs as TP x PCP real processes joined by real gloo groups over loopback (one TP group per
PCP rank, one PCP group per TP rank, as the prefill service builds them; TP=1 x PCP=1 is one process with no
group), each rank with --threads-per-rank torch threads, its TP shard of the model, and the same code path
the prefill service runs (DualChunkSwap share, K/V all-gather per layer over its PCP group, through shared
memory as the service's ranks on one host do, the TP all-reduces, last-position logits, first-token
sampling). The time is global rank 0's wall clock from a
barrier to the moment every rank is done, median over repeats after one warm-up round. The PCP sizes of one
TP size run interleaved (their sets all up, one prefill each in turn, round after round), so their ratio
holds on a host whose speed drifts by tens of percent over minutes. On a machine with fewer cores than
ranks, TP adds processes, not cores: the rows then show its communication cost, not its speedup.

Beside the wall clock each row gives what tells the code from the host: the slowest rank's thread CPU time
(its work; PCP=2 over PCP=1 in CPU time is `cpu_speedup`) and the cores other processes kept busy during
the timed runs (`background_cores_median`, from /proc/stat). Ranks that exchange K/V every layer move at
the pace of the slower one, so background load on a machine with as many cores as ranks stretches PCP=2
and not PCP=1: a wall speedup far below the CPU one, with background above 0, is the host, not the code.
"""

from __future__ import annotations

import argparse
import os
import queue as queue_module
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.machine import machine_facts, two_process_scaling
from pcpstack.common.config import served_model_name
from pcpstack.common.ports import free_port
from pcpstack.engine.engine import Engine
from pcpstack.engine.kv_cache import blocks_needed
from pcpstack.engine.parallel import SINGLE_RANK, ParallelLayout, init_parallel_groups
from pcpstack.engine.sampling import SamplingParams, make_generator, sample
from pcpstack.engine.weights import load_model
from pcpstack.prefill.context_parallel import KvAllGather, pcp_exchange_group, prefill_share
from pcpstack.prefill.split import DualChunkSplit


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the prefill benchmark."""
    parser.add_argument(
        "--tokens", type=_int_list, default=[2048, 4096], help="prompt lengths, e.g. 2048,4096"
    )
    parser.add_argument("--pcp", type=_int_list, default=[1, 2], help="PCP sizes, e.g. 1,2")
    parser.add_argument(
        "--tp", type=_int_list, default=[1], help="TP sizes inside each PCP rank, each with every PCP size"
    )
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads of each rank")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration")
    parser.add_argument("--model", default=None, help="model (default SmolLM2); 'tiny' for a smoke run")
    parser.add_argument("--block-size", type=int, default=128)


def _machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat, in clock ticks of
    10 ms: fine for runs of seconds), None where unknown."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class RunTiming:
    """One rank's view of one timed prefill."""

    wall_s: float  # barrier to barrier: the TTFT on global rank 0
    thread_cpu_s: float  # the rank's thread CPU time in its prefill (its work, not its waits)
    process_cpu_s: float  # every thread of the rank process (gloo's included), to leave out of the busy time
    machine_busy_s: float | None  # CPU seconds all cores spent busy meanwhile (None: no /proc/stat)


def _rank(global_rank: int, layout: ParallelLayout, port: int, args: dict, commands, results) -> None:
    """One rank of a configuration: loads its shard, then runs one timed prefill of n tokens for each n
    `commands` brings (every rank of the set gets the same ones), until None."""
    torch.set_num_threads(args["threads"])
    distributed = layout.world_size > 1
    pcp_rank, groups, shard = 0, None, SINGLE_RANK
    device = torch.device("cpu")
    if distributed:
        groups = init_parallel_groups(layout, global_rank, "127.0.0.1", port, device, timeout_seconds=600)
        pcp_rank, shard = groups.pcp_rank, groups.shard()
    loaded = load_model(args["model"], "cpu", shard=shard, prefill=True)  # as a prefill rank loads
    exchange_group = None
    if groups is not None:  # as a prefill rank does: shared memory when the set shares a host
        kv_row_bytes = loaded.args.n_kv_heads * loaded.args.head_dim * loaded.dtype.itemsize
        longest = max(args["tokens"])
        exchange_group = pcp_exchange_group(groups, device, longest, kv_row_bytes, str(port), 600)
    block_size = args["block_size"]
    engine = Engine(loaded, block_size=block_size, num_blocks=blocks_needed(max(args["tokens"]), block_size))
    vocab_size = loaded.full_args.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0)
    while (n := commands.get()) is not None:
        prompt = torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        split = DualChunkSplit(n, layout.pcp_size)
        if distributed:
            dist.barrier()
        busy, process_cpu = _machine_busy_s(), time.process_time()
        started, thread_cpu = time.perf_counter(), time.thread_time()
        state = engine.reserve("bench", n)
        exchange = KvAllGather(split, group=exchange_group) if layout.pcp_size > 1 else None
        logits = prefill_share(engine, state, prompt, split, pcp_rank, exchange)
        if logits is not None:
            sample(logits, params, make_generator(None))
        thread_cpu = time.thread_time() - thread_cpu  # this rank's work, without the wait for the others
        if distributed:
            dist.barrier()  # TTFT ends when the slowest rank is done (the last token may be elsewhere)
        elapsed = time.perf_counter() - started
        busy_after = _machine_busy_s()
        machine_busy = None if busy is None or busy_after is None else busy_after - busy
        engine.free("bench")
        results.put(
            (global_rank, RunTiming(elapsed, thread_cpu, time.process_time() - process_cpu, machine_busy))
        )
    if distributed:
        dist.destroy_process_group()


class RankSet:
    """The processes of one configuration (TP x PCP real ranks), alive across the rounds of the benchmark,
    each waiting for the next prompt length to prefill."""

    def __init__(self, ctx, layout: ParallelLayout, args: dict) -> None:
        self.layout = layout
        self._commands = [ctx.Queue() for _ in range(layout.world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_rank, args=(g, layout, port, args, self._commands[g], self._results))
            for g in range(layout.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def prefill(self, n: int) -> list[RunTiming]:
        """One timed prefill of n tokens on every rank; their timings in global rank order."""
        for commands in self._commands:
            commands.put(n)
        timings: dict[int, RunTiming] = {}
        while len(timings) < len(self._procs):
            try:
                global_rank, timing = self._results.get(timeout=1.0)
                timings[global_rank] = timing
            except queue_module.Empty:
                # A rank that died (a port taken under it, out of memory) would leave the others waiting.
                failed = [g for g, proc in enumerate(self._procs) if proc.exitcode not in (None, 0)]
                if failed:
                    layout = self.layout
                    raise RuntimeError(
                        f"bench prefill: rank {failed[0]} of TP={layout.tp_size} x PCP={layout.pcp_size} "
                        f"exited with status {self._procs[failed[0]].exitcode} (its error is above)"
                    ) from None
        return [timings[g] for g in range(len(self._procs))]

    def close(self) -> None:
        """Lets the ranks finish (killing those that do not)."""
        for commands in self._commands:
            commands.put(None)
        for proc in self._procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def _measure_side_by_side(
    layouts: list[ParallelLayout], args: dict
) -> dict[ParallelLayout, dict[int, list[list[RunTiming]]]]:
    """Runs the configurations `layouts` side by side: every set stays up, and each round prefills every
    length on one set after the other (the order reversed every other round), so a host whose speed drifts
    over minutes slows them alike. Round 0 warms up. Per layout, per length, per timed round: every global
    rank's RunTiming."""
    ctx = mp.get_context("spawn")
    sets = []
    try:
        for layout in layouts:
            sets.append(RankSet(ctx, layout, args))
        timings: dict[ParallelLayout, dict[int, list[list[RunTiming]]]] = {layout: {} for layout in layouts}
        for round_index in range(args["repeats"] + 1):
            for n in args["tokens"]:
                for rank_set in sets if round_index % 2 else reversed(sets):
                    runs = rank_set.prefill(n)
                    if round_index:  # the first round warms up allocators and caches
                        timings[rank_set.layout].setdefault(n, []).append(runs)
        return timings
    finally:
        for rank_set in sets:
            rank_set.close()


def _row(n: int, tp: int, pcp: int, repeats: list[list[RunTiming]]) -> dict:
    """The result row of one configuration at n tokens from every repeat's RunTimings (global rank 0's
    first)."""
    times = [runs[0].wall_s for runs in repeats]
    row = {
        "tokens": n,
        "tp": tp,
        "pcp": pcp,
        "ttft_s_median": round(statistics.median(times), 4),
        "ttft_s_min": round(min(times), 4),
        "ttft_s_max": round(max(times), 4),
        "tokens_per_s": round(n / statistics.median(times), 1),
        "slowest_rank_cpu_s_median": round(
            statistics.median(max(run.thread_cpu_s for run in runs) for runs in repeats), 4
        ),
    }
    if all(runs[0].machine_busy_s is not None for runs in repeats):
        # Busy core-seconds not spent by the ranks themselves, per second of the run.
        background = [
            (runs[0].machine_busy_s - sum(run.process_cpu_s for run in runs)) / runs[0].wall_s
            for runs in repeats
        ]
        row["background_cores_median"] = round(max(statistics.median(background), 0.0), 2)
    return row


def run(args: argparse.Namespace) -> dict:
    """Runs every (tokens, tp, pcp) configuration; returns medians, spread and the PCP speedups of TP=1 (a
    TP row's speedup over TP=1 x PCP=1 is the report's to compute from the rows)."""
    facts = machine_facts()  # before any rank loads: the load average says how busy the machine already was
    # What two one-thread processes get done together against one alone: the ceiling of PCP=2 over PCP=1.
    scaling = two_process_scaling(
        seconds=0.5 if args.repeats <= 1 else 2.0, rounds=1 if args.repeats <= 1 else 3
    )
    settings = {
        "model": args.model,
        "tokens": args.tokens,
        "threads": args.threads_per_rank,
        "repeats": args.repeats,
        "block_size": args.block_size,
    }
    rows = []
    for tp in args.tp:
        # The PCP sizes of one TP size run interleaved: their ratio is the speedup the report gives.
        layouts = [ParallelLayout(tp_size=tp, pcp_size=pcp) for pcp in args.pcp]
        for layout, by_length in _measure_side_by_side(layouts, settings).items():
            for n, repeats in by_length.items():
                rows.append(_row(n, tp, layout.pcp_size, repeats))
    return {
        "benchmark": "prefill",
        "model": served_model_name(args.model),
        "threads_per_rank": args.threads_per_rank,
        "repeats": args.repeats,
        **facts,
        "two_process_scaling": scaling,
        "lockstep_scaling": scaling["lockstep"],  # the key the report reads, in older results too
        "results": rows,
        "speedup": _speedups(rows, "ttft_s_median"),
        # The same ratio in the slowest rank's CPU time: what the code scales, whatever else the host runs.
        "cpu_speedup": _speedups(rows, "slowest_rank_cpu_s_median"),
    }


def _speedups(rows: list[dict], key: str) -> dict[str, float]:
    """PCP=1's `key` over PCP=n's at each length, for TP=1."""
    base = {r["tokens"]: r[key] for r in rows if r["pcp"] == 1 and r["tp"] == 1}
    return {
        f"pcp{r['pcp']}_over_pcp1_at_{r['tokens']}": round(base[r["tokens"]] / r[key], 3)
        for r in rows
        if r["pcp"] > 1 and r["tp"] == 1 and r["tokens"] in base
    }
