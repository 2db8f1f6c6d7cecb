"""`pcpstack bench prefill`: time to first token of context-parallel prefill, PCP=1 against PCP>1, and of
tensor parallelism inside each PCP rank (`--tp 1,3`: every TP x PCP pair).

Each configuration runs as TP x PCP real processes joined by real gloo groups over loopback (one TP group per
PCP rank, one PCP group per TP rank, as the prefill service builds them; TP=1 x PCP=1 is one process with no
group), each rank with --threads-per-rank torch threads, its TP shard of the model, and the same code path
the prefill service runs (DualChunkSwap share, K/V all-gather per layer over its PCP group, the TP
all-reduces, last-position logits, first-token sampling). The time is global rank 0's wall clock from a
barrier to the moment every rank is done, median over repeats after one warm-up. On a machine with fewer
cores than ranks, TP adds processes, not cores: the rows then show its communication cost, not its speedup.
"""

from __future__ import annotations

import argparse
import queue as queue_module
import statistics
import time

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
from pcpstack.prefill.context_parallel import KvAllGather, prefill_share
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


def _rank(global_rank: int, layout: ParallelLayout, port: int, args: dict, queue) -> None:
    torch.set_num_threads(args["threads"])
    distributed = layout.world_size > 1
    pcp_rank, pcp_group, shard = 0, None, SINGLE_RANK
    if distributed:
        device = torch.device("cpu")
        groups = init_parallel_groups(layout, global_rank, "127.0.0.1", port, device, timeout_seconds=600)
        pcp_rank, pcp_group, shard = groups.pcp_rank, groups.pcp_group, groups.shard()
    loaded = load_model(args["model"], "cpu", shard=shard)
    block_size = args["block_size"]
    engine = Engine(loaded, block_size=block_size, num_blocks=blocks_needed(max(args["tokens"]), block_size))
    vocab_size = loaded.full_args.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0)
    timings: dict[int, list[float]] = {}
    for n in args["tokens"]:
        prompt = torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        split = DualChunkSplit(n, layout.pcp_size)
        for repeat in range(args["repeats"] + 1):
            if distributed:
                dist.barrier()
            started = time.perf_counter()
            state = engine.reserve("bench", n)
            exchange = KvAllGather(split, group=pcp_group) if layout.pcp_size > 1 else None
            logits = prefill_share(engine, state, prompt, split, pcp_rank, exchange)
            if logits is not None:
                sample(logits, params, make_generator(None))
            if distributed:
                dist.barrier()  # TTFT ends when the slowest rank is done (the last token may be elsewhere)
            elapsed = time.perf_counter() - started
            engine.free("bench")
            if repeat:  # the first run warms up allocators and caches
                timings.setdefault(n, []).append(elapsed)
    if distributed:
        dist.destroy_process_group()
    queue.put((global_rank, timings))


def _measure(layout: ParallelLayout, args: dict) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(g, layout, port, args, queue)) for g in range(layout.world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, dict[int, list[float]]] = {}
    try:
        while len(results) < len(procs):
            try:
                global_rank, timings = queue.get(timeout=1.0)
                results[global_rank] = timings
            except queue_module.Empty:
                # A rank that died (a port taken under it, out of memory) would leave the others waiting.
                failed = [g for g, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
                if failed:
                    for proc in procs:
                        proc.kill()
                    raise RuntimeError(
                        f"bench prefill: rank {failed[0]} of TP={layout.tp_size} x PCP={layout.pcp_size} "
                        f"exited with status {procs[failed[0]].exitcode} (its error is above)"
                    ) from None
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return results[0]


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
        for pcp in args.pcp:
            for n, times in _measure(ParallelLayout(tp_size=tp, pcp_size=pcp), settings).items():
                rows.append(
                    {
                        "tokens": n,
                        "tp": tp,
                        "pcp": pcp,
                        "ttft_s_median": round(statistics.median(times), 4),
                        "ttft_s_min": round(min(times), 4),
                        "ttft_s_max": round(max(times), 4),
                        "tokens_per_s": round(n / statistics.median(times), 1),
                    }
                )
    base = {r["tokens"]: r["ttft_s_median"] for r in rows if r["pcp"] == 1 and r["tp"] == 1}
    speedups = {
        f"pcp{r['pcp']}_over_pcp1_at_{r['tokens']}": round(base[r["tokens"]] / r["ttft_s_median"], 3)
        for r in rows
        if r["pcp"] > 1 and r["tp"] == 1 and r["tokens"] in base
    }
    return {
        "benchmark": "prefill",
        "model": served_model_name(args.model),
        "threads_per_rank": args.threads_per_rank,
        "repeats": args.repeats,
        **facts,
        "two_process_scaling": scaling,
        "results": rows,
        "speedup": speedups,
    }
