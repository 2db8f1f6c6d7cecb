"""`pcpstack bench prefill`: time to first token of context-parallel prefill, PCP=1 against PCP>1.

Each configuration runs as real processes joined by a real gloo group over loopback (PCP=1 is one process
with no group), each rank with --threads-per-rank torch threads and the same code path the prefill service
runs (DualChunkSwap share, K/V all-gather per layer, last-position logits, first-token sampling). The time
is rank 0's wall clock from a barrier to its first token, median over repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pcpstack.cli.stack import free_port
from pcpstack.common.config import served_model_name
from pcpstack.engine.engine import Engine
from pcpstack.engine.kv_cache import blocks_needed
from pcpstack.engine.sampling import SamplingParams, make_generator, sample
from pcpstack.prefill.context_parallel import KvAllGather, init_pcp_group, prefill_share
from pcpstack.prefill.split import DualChunkSplit


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the prefill benchmark."""
    parser.add_argument(
        "--tokens", type=_int_list, default=[2048, 4096], help="prompt lengths, e.g. 2048,4096"
    )
    parser.add_argument("--pcp", type=_int_list, default=[1, 2], help="PCP sizes, e.g. 1,2")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads of each rank")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration")
    parser.add_argument("--model", default=None, help="model (default SmolLM2); 'tiny' for a smoke run")
    parser.add_argument("--block-size", type=int, default=128)


def _rank(pcp_rank: int, pcp: int, port: int, args: dict, queue) -> None:
    torch.set_num_threads(args["threads"])
    if pcp > 1:
        init_pcp_group("127.0.0.1", port, pcp_rank, pcp, torch.device("cpu"), timeout_seconds=600)
    engine = Engine.load(
        args["model"],
        block_size=args["block_size"],
        num_blocks=blocks_needed(max(args["tokens"]), args["block_size"]),
    )
    params = SamplingParams(max_tokens=1, temperature=0)
    timings: dict[int, list[float]] = {}
    for n in args["tokens"]:
        prompt = torch.randint(0, engine.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        split = DualChunkSplit(n, pcp)
        for repeat in range(args["repeats"] + 1):
            if pcp > 1:
                dist.barrier()
            started = time.perf_counter()
            state = engine.reserve("bench", n)
            logits = prefill_share(
                engine, state, prompt, split, pcp_rank, KvAllGather(split) if pcp > 1 else None
            )
            if logits is not None:
                sample(logits, params, make_generator(None))
            if pcp > 1:
                dist.barrier()  # TTFT ends when the slowest rank is done (the last token may be elsewhere)
            elapsed = time.perf_counter() - started
            engine.free("bench")
            if repeat:  # the first run warms up allocators and caches
                timings.setdefault(n, []).append(elapsed)
    if pcp > 1:
        dist.destroy_process_group()
    queue.put((pcp_rank, timings))


def _measure(pcp: int, args: dict) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, pcp, port, args, queue)) for r in range(pcp)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return results[0]


def run(args: argparse.Namespace) -> dict:
    """Runs every (tokens, pcp) configuration; returns medians, spread and PCP speedups."""
    settings = {
        "model": args.model,
        "tokens": args.tokens,
        "threads": args.threads_per_rank,
        "repeats": args.repeats,
        "block_size": args.block_size,
    }
    rows = []
    for pcp in args.pcp:
        for n, times in _measure(pcp, settings).items():
            rows.append(
                {
                    "tokens": n,
                    "pcp": pcp,
                    "ttft_s_median": round(statistics.median(times), 4),
                    "ttft_s_min": round(min(times), 4),
                    "ttft_s_max": round(max(times), 4),
                    "tokens_per_s": round(n / statistics.median(times), 1),
                }
            )
    base = {r["tokens"]: r["ttft_s_median"] for r in rows if r["pcp"] == 1}
    speedups = {
        f"pcp{r['pcp']}_over_pcp1_at_{r['tokens']}": round(base[r["tokens"]] / r["ttft_s_median"], 3)
        for r in rows
        if r["pcp"] > 1 and r["tokens"] in base
    }
    return {
        "benchmark": "prefill",
        "model": served_model_name(args.model),
        "threads_per_rank": args.threads_per_rank,
        "repeats": args.repeats,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "results": rows,
        "speedup": speedups,
    }
