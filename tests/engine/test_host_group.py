"""Shared-memory host collectives (engine.host_group) among real processes joined by a real gloo group:
results equal to gloo's, in rank order on every rank, the gloo fallback for tensors over a slot, and a
peer that dies making the others fail at once instead of waiting for the collective timeout."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pcpstack.common.ports import free_port
from pcpstack.engine.host_group import HostGroup, HostGroupError, host_collectives_available

pytestmark = pytest.mark.skipif(not host_collectives_available(), reason="no futex/dev-shm host collectives")

WORLD = 3
SLOT = 4096  # bytes: small enough to send a larger tensor through the fallback


def _members(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    group = HostGroup.create(range(WORLD), f"test-{port}", SLOT, 30.0, dist.group.WORLD)
    pair = HostGroup.create([1, 2], f"test-{port}-pair", SLOT, 30.0, None)
    generator = torch.Generator().manual_seed(rank)
    small = torch.randn(4, 32, generator=generator)  # 512 bytes: through the segment
    large = torch.randn(64, 32, generator=generator)  # 8 KiB: through gloo
    outcome = {
        "sum": group.all_reduce_sum(small.clone()),
        "gloo_sum": _gloo_sum(small),
        "large_sum": group.all_reduce_sum(large.clone()),
        "gloo_large_sum": _gloo_sum(large),
        "gather": group.all_gather(torch.tensor([rank, 10 * rank])),
        # Many operations in a row: the two buffers alternate and no rank may overtake another.
        "repeated": [group.all_reduce_sum(torch.full((3,), float(rank + i))) for i in range(200)][-1],
        "pair": None if pair is None else pair.all_gather(torch.tensor([rank])),
        "not_in_pair": pair is None,
    }
    results[rank] = outcome
    dist.barrier()
    dist.destroy_process_group()


def _gloo_sum(tensor: torch.Tensor) -> torch.Tensor:
    summed = tensor.clone()
    dist.all_reduce(summed)
    return summed


def test_host_collectives_equal_gloo_and_keep_rank_order() -> None:
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_members, args=(free_port(), results), nprocs=WORLD)
    outcomes = [results[r] for r in range(WORLD)]
    for outcome in outcomes:
        torch.testing.assert_close(outcome["sum"], outcome["gloo_sum"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(outcome["large_sum"], outcome["gloo_large_sum"], rtol=1e-6, atol=1e-6)
        assert outcome["gather"].tolist() == [[r, 10 * r] for r in range(WORLD)]
        assert outcome["repeated"].tolist() == [float(sum(r + 199 for r in range(WORLD)))] * 3
    # Every rank gets bit-identical sums (each adds the slots in rank order).
    assert all(torch.equal(o["sum"], outcomes[0]["sum"]) for o in outcomes)
    assert outcomes[0]["not_in_pair"] and [o["pair"].tolist() for o in outcomes[1:]] == [[[1], [2]]] * 2


def _dies_or_waits(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = HostGroup.create(range(2), f"test-{port}", SLOT, 600.0, dist.group.WORLD)
    group.all_reduce_sum(torch.ones(2))
    if rank == 1:
        os._exit(0)  # gone without a word, as after kill -9
    try:
        group.all_reduce_sum(torch.ones(2))
        results[0] = "completed"
    except HostGroupError as exc:
        results[0] = str(exc)


def test_a_dead_peer_fails_the_collective_instead_of_waiting_for_its_timeout() -> None:
    # The timeout is 600 s: a failure within the test's 90 s wait can only come from noticing the dead peer.
    results = mp.get_context("spawn").Manager().dict()
    context = mp.start_processes(
        _dies_or_waits, args=(free_port(), results), nprocs=2, join=False, start_method="spawn"
    )
    for process in context.processes:
        process.join(90)
        if process.is_alive():
            process.kill()
    assert "rank 1" in results.get(0, "no result within 90 s") and "has exited" in results[0]
