"""Runs context-parallel prefill in real processes joined by a real gloo group, for the exactness tests.

`run_pcp(model, pcp_size, lengths, chunk_tokens, held)` spawns pcp_size processes; each loads the model,
joins the group over tcp:// on loopback, prefills every prompt length with its DualChunkSwap share (in chunks
of chunk_tokens when > 0; after a prefix of held[n] tokens that every rank first loads as a cached replica,
as prefix reuse will) and returns its logits (on the rank owning the last position) and its complete KV
replica for every length. `run_group(pcp_size, work, *args)` runs any such per-rank work in the same way
(`prefill_models`: one prompt with each of several models).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pcpstack.common.ports import free_port
from pcpstack.engine.engine import Engine
from pcpstack.engine.kv_cache import blocks_needed
from pcpstack.prefill.context_parallel import KvAllGather, init_pcp_group, prefill_chunked
from pcpstack.prefill.split import DualChunkSplit

BLOCK_SIZE = 16


def prompt(vocab_size: int, n: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(n))


def load_held_prefix(engine: Engine, seq_id: int, ids: torch.Tensor) -> None:
    """Starts sequence seq_id from ids' K/V as a replica from the store would arrive: computed elsewhere (a
    single-rank prefill of a scratch sequence), exported, adopted."""
    engine.prefill("scratch", ids.tolist())
    kv = engine.export_sequence("scratch").clone()
    engine.free("scratch")
    engine.adopt_sequence(seq_id, kv, len(ids))


def prefill_all(
    model_name: str | None,
    pcp_rank: int,
    pcp_size: int,
    lengths: list[int],
    group: bool,
    chunk_tokens: int = 0,
    held: dict[int, int] | None = None,
):
    """[(logits or None, replica)] for every length, computed as rank pcp_rank of pcp_size (in chunks of
    chunk_tokens when > 0, after loading a held prefix of held[n] tokens when given)."""
    torch.set_num_threads(1)
    engine = Engine.load(
        model_name, block_size=BLOCK_SIZE, num_blocks=blocks_needed(max(lengths), BLOCK_SIZE)
    )
    results = []
    for n in lengths:
        ids = prompt(engine.args.vocab_size, n)
        start = (held or {}).get(n, 0)
        if start:
            load_held_prefix(engine, n, ids[:start])
        state = engine.reserve(n, n)

        def exchange_for(split: DualChunkSplit) -> KvAllGather | None:
            return KvAllGather(split) if group else None

        logits = prefill_chunked(
            engine, state, ids[start:], pcp_rank, pcp_size, chunk_tokens, exchange_for, start
        )
        results.append((logits, engine.export_sequence(n).clone()))
        engine.free(n)
    return results


def prefill_models(pcp_rank: int, pcp_size: int, paths: list[str], ids: list[int], chunk_tokens: int):
    """[(logits or None, replica)] of the prompt ids prefilled in fp32 with each model of paths in turn, as
    rank pcp_rank of pcp_size (in chunks of chunk_tokens when > 0): many models for one process group."""
    torch.set_num_threads(1)
    results = []
    for path in paths:
        engine = Engine.load(
            path, "cpu", torch.float32, block_size=BLOCK_SIZE, num_blocks=blocks_needed(len(ids), BLOCK_SIZE)
        )
        state = engine.reserve(0, len(ids))
        ids_tensor = torch.tensor(ids)
        logits = prefill_chunked(engine, state, ids_tensor, pcp_rank, pcp_size, chunk_tokens, KvAllGather)
        results.append((logits, engine.export_sequence(0).clone()))
    return results


Work = Callable[..., list[tuple[torch.Tensor | None, torch.Tensor]]]


def _prefill_in_group(
    pcp_rank: int,
    pcp_size: int,
    model_name: str | None,
    lengths: list[int],
    chunk_tokens: int,
    held: dict[int, int] | None,
):
    return prefill_all(model_name, pcp_rank, pcp_size, lengths, True, chunk_tokens, held)


def _child(pcp_rank: int, pcp_size: int, port: int, work: Work, args: tuple, queue) -> None:
    init_pcp_group("127.0.0.1", port, pcp_rank, pcp_size, torch.device("cpu"), timeout_seconds=120)
    try:
        results = work(pcp_rank, pcp_size, *args)
        # numpy pickles by value; a tensor would travel as a shared-memory handle that dies with this process.
        queue.put((pcp_rank, [(None if lg is None else lg.numpy(), kv.numpy()) for lg, kv in results]))
    finally:
        dist.destroy_process_group()


def assert_equal_to_single_rank(
    reference: list, ranks: dict[int, list], lengths: list[int], pcp_size: int, tol: float
) -> None:
    """Every length's first-token logits (on the one rank that returned them) and every rank's replica
    within tol of the single-rank reference, and the ranks' replicas identical bit for bit."""
    for i, n in enumerate(lengths):
        ref_logits, ref_kv = reference[i]
        with_logits = [rank for rank in range(pcp_size) if ranks[rank][i][0] is not None]
        assert len(with_logits) == 1, f"n={n}: ranks {with_logits} returned logits"
        logits = ranks[with_logits[0]][i][0]
        err = (logits - ref_logits).abs().max().item()
        assert err <= tol, f"n={n}: first-token logits differ by {err}"
        assert logits.argmax() == ref_logits.argmax()
        for rank in range(pcp_size):
            kv = ranks[rank][i][1]
            assert kv.shape == ref_kv.shape
            kv_err = (kv - ref_kv).abs().max().item()
            assert kv_err <= tol, f"n={n} rank={rank}: K/V differ by {kv_err}"
            assert torch.equal(kv, ranks[0][i][1]), f"n={n}: the replica of rank {rank} differs from rank 0's"


def run_pcp(
    model_name: str | None,
    pcp_size: int,
    lengths: list[int],
    chunk_tokens: int = 0,
    held: dict[int, int] | None = None,
) -> dict[int, list]:
    """Results of prefill_all on every rank of a real pcp_size-process gloo group, by rank."""
    return run_group(pcp_size, _prefill_in_group, model_name, lengths, chunk_tokens, held)


def _results(queue, procs: list, timeout: float = 600.0) -> list:
    """One result per rank process; fails at once, naming the rank, when a process dies without sending
    one (a crash would otherwise leave its peers blocked in a collective and this wait running its whole
    timeout)."""
    results: list = []
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=1.0))
            continue
        except Empty:
            pass
        sent = {rank for rank, _ in results}
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in sent and p.exitcode is not None]
        if dead:
            raise AssertionError(f"rank process(es) exited without a result (rank, exit code): {dead}")
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - sent)
            raise AssertionError(f"no result from ranks {missing} in {timeout} s")
    return results


def run_group(pcp_size: int, work: Work, *args) -> dict[int, list]:
    """Results of work(pcp_rank, pcp_size, *args) ([(logits or None, replica)], a module-level function) on
    every rank of a real pcp_size-process gloo group, by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, pcp_size, port, work, args, queue)) for r in range(pcp_size)]
    for proc in procs:
        proc.start()
    try:
        received = dict(_results(queue, procs))
        results = {
            rank: [
                (None if lg is None else torch.from_numpy(lg), torch.from_numpy(kv)) for lg, kv in per_length
            ]
            for rank, per_length in received.items()
        }
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return results
