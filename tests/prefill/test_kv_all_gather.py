"""The K/V all-gather of context-parallel prefill (KvAllGather) over a real gloo group, and over the
shared-memory HostGroup that ranks on one host use: every rank hands in the K/V rows of its DualChunkSwap
share and gets back the whole prompt's (or a batch's) K/V in position order, bit for bit, padding dropped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from pcpstack.engine.host_group import HostGroup, host_collectives_available
from pcpstack.engine.parallel import ParallelGroups, ParallelLayout
from pcpstack.prefill.batch import BatchSplit
from pcpstack.prefill.context_parallel import KvAllGather, _host_identity, pcp_exchange_group
from pcpstack.prefill.split import DualChunkSplit
from tests.prefill.cp_harness import run_group

KV_HEADS, HEAD_DIM = 3, 8


def whole_kv(num_tokens: int) -> torch.Tensor:
    """[2, n, kv_heads, head_dim]: K and V of every position, the same on every rank."""
    generator = torch.Generator().manual_seed(num_tokens)
    return torch.randn(2, num_tokens, KV_HEADS, HEAD_DIM, generator=generator)


def local_rows(plan: DualChunkSplit | BatchSplit, pcp_rank: int) -> list[int]:
    """Rows of the whole K/V this rank computes, in its local order (a batch: sequence by sequence)."""
    if isinstance(plan, DualChunkSplit):
        return plan.positions(pcp_rank)
    rows, offset = [], 0
    for split in plan.splits:
        rows += [offset + p for p in split.positions(pcp_rank)]
        offset += split.num_tokens
    return rows


def _exchange(pcp_rank: int, pcp_size: int, batches: list[tuple[int, ...]]):
    results = []
    for lengths in batches:
        plan = DualChunkSplit(lengths[0], pcp_size) if len(lengths) == 1 else BatchSplit(lengths, pcp_size)
        kv = whole_kv(sum(lengths))
        rows = torch.tensor(local_rows(plan, pcp_rank), dtype=torch.long)
        k, v = KvAllGather(plan)(kv[0, rows], kv[1, rows])
        results.append((None, torch.stack((k, v))))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("pcp", [2, 3])
def test_every_rank_gets_the_whole_kv_in_position_order(pcp: int) -> None:
    # 1 and 2 leave ranks without tokens, 2P + 1 and 1031 pad the narrower shares; the tuples are batches.
    batches = [(1,), (2,), (2 * pcp,), (2 * pcp + 1,), (1031,), (5, 1, 64), (1, 2 * pcp + 3)]
    ranks = run_group(pcp, _exchange, batches)
    for rank in range(pcp):
        for lengths, (_, gathered) in zip(batches, ranks[rank], strict=True):
            assert torch.equal(gathered, whole_kv(sum(lengths))), f"rank {rank}, lengths {lengths}"


def test_a_set_of_one_rank_hands_its_kv_back_without_a_collective() -> None:
    """PCP=1: the very tensors it was given (an all-gather, where a default group exists at all, would
    return new ones), and progress still reported per layer."""
    layers: list[int] = []
    for plan in (DualChunkSplit(1031, 1), BatchSplit((5, 1, 64), 1)):
        local_k, local_v = whole_kv(plan.num_tokens)
        k, v = KvAllGather(plan, on_progress=lambda: layers.append(1))(local_k, local_v)
        assert k is local_k and v is local_v
    assert len(layers) == 2


def _exchange_on_one_host(pcp_rank: int, pcp_size: int, batches: list[tuple[int, ...]], slot_tokens: int):
    world = dist.group.WORLD
    groups = ParallelGroups(ParallelLayout(1, pcp_size), pcp_rank, world, world, world)
    row_bytes = KV_HEADS * HEAD_DIM * 4
    tag = f"test{os.getppid()}"  # the test process: one tag for all its ranks, unique on the host
    group = pcp_exchange_group(groups, torch.device("cpu"), slot_tokens, row_bytes, tag, 60)
    if host_collectives_available():
        assert isinstance(group, HostGroup), f"rank {pcp_rank} got {group} on one host"
    else:
        assert group is world
    results = []
    for lengths in batches:
        plan = DualChunkSplit(lengths[0], pcp_size) if len(lengths) == 1 else BatchSplit(lengths, pcp_size)
        kv = whole_kv(sum(lengths))
        rows = torch.tensor(local_rows(plan, pcp_rank), dtype=torch.long)
        k, v = KvAllGather(plan, group=group)(kv[0, rows], kv[1, rows])
        results.append((None, torch.stack((k, v))))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("pcp", [2, 3])
def test_ranks_on_one_host_exchange_through_shared_memory_with_the_same_result(pcp: int) -> None:
    # Slots for a 64-token prompt: the short ones go through shared memory, 1031 through the gloo fallback.
    batches = [(1,), (2 * pcp + 1,), (64,), (1031,), (5, 1, 64), (1, 2 * pcp + 3)]
    ranks = run_group(pcp, _exchange_on_one_host, batches, 64)
    for rank in range(pcp):
        for lengths, (_, gathered) in zip(batches, ranks[rank], strict=True):
            assert torch.equal(gathered, whole_kv(sum(lengths))), f"rank {rank}, lengths {lengths}"


@pytest.mark.slow
def test_host_collectives_turned_off_leave_the_exchange_on_the_process_group(monkeypatch) -> None:
    monkeypatch.setenv("PCPSTACK_HOST_COLLECTIVES", "0")  # the spawned ranks inherit it
    batches = [(7,), (64,)]
    ranks = run_group(2, _exchange_on_one_host, batches, 64)
    for rank in range(2):
        for lengths, (_, gathered) in zip(batches, ranks[rank], strict=True):
            assert torch.equal(gathered, whole_kv(sum(lengths))), f"rank {rank}, lengths {lengths}"


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/proc/self/ns/net"), reason="needs root (unshare)"
)
def test_a_rank_in_a_network_namespace_of_its_own_counts_as_another_host() -> None:
    # The cross-host tests put ranks in network namespaces to stand for hosts: those must exchange over
    # the network, not through this host's shared memory, so they may not share a host identity.
    code = "from pcpstack.prefill.context_parallel import _host_identity; print(_host_identity())"
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    apart = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert int(here.stdout) == _host_identity()  # the same for processes of one host and namespace
    assert int(apart.stdout) != _host_identity()
