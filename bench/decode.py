"""`pcpstack bench decode`: what decode context parallelism (DCP) buys a tensor-parallel decode worker: the KV
bytes each rank holds for a long context, and the decode tokens/s it runs at, for each DCP size.

Each DCP size starts a real `TensorParallelEngine` (TP real processes over loopback gloo, the DCP groups
inside it, as the decode worker runs it), adopts `--batch` sequences of `--context` tokens and times decode
steps (median with min and max over the repeats, after one warm-up step). Per-rank KV bytes are the blocks
each rank has allocated for them (asked of every rank) times one rank's block bytes (its K/V heads only);
the largest rank is reported first, since it is what a rank's cache must fit. The replicas are seeded random
K/V of the model's layout rather than a prefill: decode's cost depends on the shapes, not the values, and a
4,096-token prefill per sequence would cost minutes on a small CPU. On a machine with fewer cores than TP
ranks, tokens/s shows the collectives' cost, not a speedup; memory per rank is the point of DCP.

`collectives` times the TP group's small collectives on their own, gloo against the shared-memory host group
a CPU decode worker uses (bench/collectives.py): an all-reduce of one step's activations over the TP ranks and
an all-gather within a DCP group.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.collectives import measure as measure_collectives
from bench.machine import machine_facts
from pcpstack.common.config import served_model_name
from pcpstack.engine.dcp import DcpShard
from pcpstack.engine.tp_engine import TensorParallelEngine
from pcpstack.engine.weights import describe_model

BLOCK_SIZE = 16


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `pcpstack bench decode`."""
    parser.add_argument("--model", default=None, help="model (default SmolLM2); 'tiny' for a smoke run")
    parser.add_argument("--tp", type=int, default=9, help="decode TP size (SmolLM2: 9 with DCP 1 or 3)")
    parser.add_argument("--dcp", type=_int_list, default=[1, 3], help="DCP sizes, e.g. 1,3")
    parser.add_argument("--context", type=int, default=4096, help="tokens of each sequence's context")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of --steps steps")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads of each rank")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="run dtype (default: device's)"
    )
    parser.add_argument(
        "--collective-rounds",
        type=int,
        default=5,
        help="rounds of the TP collectives' timing, gloo against the shared-memory host group (0 skips it)",
    )


def _measure(args: argparse.Namespace, dcp_size: int) -> dict:
    """One DCP size: start the engine, adopt the batch, read the ranks' blocks, time the decode steps."""
    # Room for the context and every step on a rank, sized for this DCP size (the cache itself shrinks).
    total = args.context + 1 + args.steps * args.repeats
    num_blocks = args.batch * DcpShard(0, dcp_size, BLOCK_SIZE).blocks_for(total) + 1
    engine = TensorParallelEngine.start(
        args.model,
        args.tp,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        threads=args.threads_per_rank,
        dcp_size=dcp_size,
    )
    try:
        layout = engine.layout
        generator = torch.Generator().manual_seed(0)
        shape = (layout.num_layers, 2, args.context, layout.num_kv_heads, layout.head_dim)
        seqs = [("decode", i) for i in range(args.batch)]
        for seq in seqs:
            kv = (torch.randn(shape, generator=generator) * 0.1).to(layout.torch_dtype)
            engine.adopt_sequence(seq, kv, args.context)
        blocks = engine.blocks_in_use()
        heads = len(engine.kv_parts(args.context)[0].kv_heads)
        itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
        block_bytes = layout.num_layers * 2 * BLOCK_SIZE * heads * layout.head_dim * itemsize
        tokens = [1] * args.batch
        tokens = engine.decode_step(seqs, tokens).argmax(-1).tolist()  # warm-up step
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.steps):
                tokens = engine.decode_step(seqs, tokens).argmax(-1).tolist()
            rates.append(args.batch * args.steps / (time.perf_counter() - start))
        return {
            "kv_bytes_per_rank": max(blocks) * block_bytes,
            "kv_blocks_per_rank": blocks,
            "block_bytes": block_bytes,
            "tokens_per_s": statistics.median(rates),
            "tokens_per_s_min": min(rates),
            "tokens_per_s_max": max(rates),
        }
    finally:
        engine.close()


def run(args: argparse.Namespace) -> dict:
    """Runs every DCP size in turn (one TP group at a time) and returns a JSON-serialisable result."""
    threads = torch.get_num_threads()
    facts = machine_facts()
    try:
        results = {str(d): _measure(args, d) for d in args.dcp}
    finally:
        torch.set_num_threads(threads)  # the TP engine sets this process's threads
    collectives = {}
    if args.collective_rounds > 0:
        # one step's activations at this batch, summed over the TP ranks and gathered within a DCP group
        gather = max(args.dcp) if max(args.dcp) > 1 else args.tp
        dim = describe_model(args.model).args.dim
        collectives = measure_collectives(args.tp, gather, args.batch, dim, rounds=args.collective_rounds)
    return {
        "model": served_model_name(args.model),
        "tp": args.tp,
        "context": args.context,
        "batch": args.batch,
        "block_size": BLOCK_SIZE,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads_per_rank": args.threads_per_rank,
        "torch": torch.__version__,
        **facts,
        "dcp": results,
        "collectives": collectives,
    }
