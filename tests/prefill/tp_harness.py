"""Runs TP × PCP prefill in real processes joined by real process groups, for the exactness tests.

`run_tp_pcp(model, tp, pcp, lengths, device)` spawns tp × pcp processes. Each joins the set's world over
tcp:// on loopback, builds its TP and PCP groups (services/engine/parallel.py), loads its TP shard of the
model on its own device, prefills every prompt length with its DualChunkSwap share (K/V all-gathered over
its PCP group), then all-gathers its K/V shard over its TP group and reassembles the whole KV by each TP
rank's K/V head range. Every rank returns its logits (ranks of the PCP rank owning the last position) and
that gathered KV, so a test can compare every rank with single-rank prefill.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pcpstack.common.ports import free_port
from pcpstack.engine.config import ModelArgs
from pcpstack.engine.device import device_for_rank
from pcpstack.engine.engine import Engine
from pcpstack.engine.kv_cache import blocks_needed
from pcpstack.engine.parallel import ParallelGroups, ParallelLayout, TensorParallelShard, init_parallel_groups
from pcpstack.engine.weights import load_model
from pcpstack.prefill.context_parallel import KvAllGather, prefill_share
from pcpstack.prefill.split import DualChunkSplit
from tests.prefill.cp_harness import BLOCK_SIZE, prompt


def gather_kv_over_tp(local_kv: torch.Tensor, groups: ParallelGroups, args: ModelArgs) -> torch.Tensor:
    """The whole KV [layers, 2, n, n_kv_heads, head_dim] from every TP rank's shard (by K/V head range)."""
    tp = groups.layout.tp_size
    shards = [torch.empty_like(local_kv) for _ in range(tp)]
    dist.all_gather(shards, local_kv.contiguous(), group=groups.tp_group)
    whole = local_kv.new_empty((*local_kv.shape[:3], args.n_kv_heads, local_kv.shape[4]))
    for tp_rank, shard in enumerate(shards):
        heads = TensorParallelShard(tp_rank, tp, groups.tp_group).kv_head_range(args)
        whole[:, :, :, heads.start : heads.stop] = shard
    return whole


def single_rank(model_name: str | None, lengths: list[int], device: torch.device) -> list:
    """[(logits, kv)] of plain single-rank prefill (no group, no shard) for every length: the reference."""
    loaded = load_model(model_name, device=device, dtype=torch.float32)
    engine = Engine(loaded, block_size=BLOCK_SIZE, num_blocks=blocks_needed(max(lengths), BLOCK_SIZE))
    results = []
    for n in lengths:
        state = engine.reserve(n, n)
        tokens = prompt(loaded.args.vocab_size, n)
        logits = prefill_share(engine, state, tokens, DualChunkSplit(n, 1), 0, None)
        results.append((logits.cpu(), engine.export_sequence(n).cpu()))
        engine.free(n)
    return results


def _child(
    global_rank: int,
    layout: ParallelLayout,
    port: int,
    model_name: str | None,
    lengths: list[int],
    device_kind: str,
    queue,
) -> None:
    torch.set_num_threads(1)
    # Every rank of this harness runs on one host: its local index is its global rank.
    device = device_for_rank(global_rank, device_kind)
    groups = init_parallel_groups(layout, global_rank, "127.0.0.1", port, device, timeout_seconds=300)
    try:
        loaded = load_model(model_name, device=device, dtype=torch.float32, shard=groups.shard())
        engine = Engine(loaded, block_size=BLOCK_SIZE, num_blocks=blocks_needed(max(lengths), BLOCK_SIZE))
        results = []
        for n in lengths:
            split = DualChunkSplit(n, layout.pcp_size)
            state = engine.reserve(n, n)
            exchange = KvAllGather(split, group=groups.pcp_group)
            tokens = prompt(loaded.full_args.vocab_size, n)
            logits = prefill_share(engine, state, tokens, split, groups.pcp_rank, exchange)
            kv = gather_kv_over_tp(engine.export_sequence(n), groups, loaded.full_args)
            engine.free(n)
            # numpy pickles by value; a tensor would travel as a shared-memory handle that dies with this
            # process.
            results.append((None if logits is None else logits.cpu().numpy(), kv.cpu().numpy()))
        queue.put((global_rank, results))
    finally:
        dist.destroy_process_group()


def run_tp_pcp(
    model_name: str | None, tp: int, pcp: int, lengths: list[int], device_kind: str = "cpu"
) -> dict[tuple[int, int], list]:
    """Results of every rank of a real tp × pcp set, by (pcp_rank, tp_rank): [(logits or None, kv)]."""
    layout = ParallelLayout(tp_size=tp, pcp_size=pcp)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(g, layout, port, model_name, lengths, device_kind, queue))
        for g in range(layout.world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        received = dict(queue.get(timeout=900) for _ in procs)
        return {
            layout.coordinates(g): [
                (None if lg is None else torch.from_numpy(lg), torch.from_numpy(kv)) for lg, kv in per_length
            ]
            for g, per_length in received.items()
        }
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
