"""Context-parallel prefill on one PCP rank: its DualChunkSwap share, with K/V all-gathered per layer.

Each rank embeds and runs only its own tokens, at their true positions. In every attention layer the
engine calls the seam `kv_exchange(k, v)`; here that is `KvAllGather`, which pads the local K/V to the
largest share, all-gathers them over the PCP process group, and restores position order. Every rank then
writes the whole prompt's K/V into its own cache (a complete replica) and attends its local queries to it
under a causal mask on true positions. Only the rank holding the last prompt position computes logits.

On the CPU, when every rank of the set shares this host (one kernel, one /dev/shm), the exchange goes
through a shared-memory HostGroup (engine.host_group) instead of gloo's TCP ring: at 4,096 SmolLM2 tokens,
PCP=2, a rank's wait beyond its own work fell from 0.55 to 0.20 s (medians of 6 interleaved rounds).

The same step appends new tokens after tokens every rank already holds in its cache (`start` > 0): only the
new tokens are split and exchanged, and they attend to the held prefix and to each other at their true
positions. Chunked prefill (`prefill_chunked`) is that step repeated, chunk after chunk; prefix reuse is the
same step after loading a cached prefix into every rank.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from pcpstack.engine.engine import Engine, SequenceState
from pcpstack.engine.host_group import HostGroup, host_collectives_available
from pcpstack.engine.parallel import ParallelGroups, distributed_backend
from pcpstack.prefill.split import DualChunkSplit


def init_pcp_group(
    master_addr: str,
    master_port: int,
    pcp_rank: int,
    pcp_size: int,
    device: torch.device,
    timeout_seconds: float,
) -> None:
    """Joins this process to a PCP-only world (tcp:// rendezvous at the master), as the PCP harnesses and
    benchmarks run it; the prefill service's ranks join with engine.parallel.init_parallel_groups."""
    dist.init_process_group(
        backend=distributed_backend(device),
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=pcp_rank,
        world_size=pcp_size,
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )


def gloo_interface_for(address: str) -> str | None:
    """The network interface holding IPv4 `address`, so gloo binds the right one on multi-homed hosts."""
    import fcntl
    import socket
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def configure_gloo_interface(address: str) -> None:
    """Points gloo at the interface of this node's advertised address unless the user already chose one.

    Any 127.x address is on the loopback interface (local stacks give each set its own 127.0.0.x master).
    """
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    name = "lo" if address.startswith("127.") else gloo_interface_for(address)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _host_identity() -> int:
    """Equal on processes that share a kernel, a /dev/shm mount and a network namespace: a segment one
    creates the others open (containers on one host may each have their own /dev/shm), and ranks placed in
    network namespaces of their own (as the cross-host tests place them) are treated as the separate hosts
    they stand for, exchanging over the network."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    shm = os.stat("/dev/shm").st_dev
    net = os.stat("/proc/self/ns/net").st_ino
    return int.from_bytes(hashlib.blake2b(f"{boot}:{shm}:{net}".encode(), digest_size=7).digest(), "little")


def pcp_exchange_group(
    groups: ParallelGroups,
    device: torch.device,
    max_tokens: int,
    kv_row_bytes: int,
    tag: str,
    timeout_s: float,
) -> dist.ProcessGroup | HostGroup:
    """The group this rank's KvAllGather exchanges over: a shared-memory HostGroup of its PCP group when the
    ranks run on the CPU and the whole set shares this host and has room in /dev/shm, else the PCP process
    group. Collective over the set's world (every rank calls it, in the same order).

    The slots hold the widest share of a `max_tokens` prompt (the longest forward), `kv_row_bytes` per K or V
    row of this rank's heads; a longer exchange goes over the PCP process group (HostGroup's fallback).
    `tag` must be unique among the host's live groups (e.g. the set's master port)."""
    layout = groups.layout
    if layout.pcp_size == 1:
        return groups.pcp_group
    slot_bytes = 2 * DualChunkSplit(max_tokens, layout.pcp_size).max_local_tokens * kv_row_bytes
    identity, usable = 0, device.type == "cpu" and host_collectives_available()
    if usable:
        identity = _host_identity()
        shm = os.statvfs("/dev/shm")
        # Twice the segments: /dev/shm is shared with the KV store's objects on this host.
        usable = shm.f_bavail * shm.f_frsize >= 2 * (2 * layout.pcp_size * slot_bytes) * layout.tp_size
    # One decision for all (a rank deciding alone would leave the others in HostGroup.create): every rank
    # able to, on the same host, with room for every PCP group's segment.
    vote = torch.tensor([identity, usable], dtype=torch.long)
    votes = [torch.empty_like(vote) for _ in range(layout.world_size)]
    dist.all_gather(votes, vote, group=groups.control)
    if any(not torch.equal(other, vote) or not other[1] for other in votes):
        return groups.pcp_group
    mine: HostGroup | None = None
    for tp_rank in range(layout.tp_size):
        ranks = layout.pcp_group_ranks(tp_rank)
        created = HostGroup.create(ranks, f"{tag}-pcp{tp_rank}", slot_bytes, timeout_s, groups.pcp_group)
        mine = created or mine
    assert mine is not None  # every rank is in one PCP group
    return mine


class GatherPlan(Protocol):
    """What the K/V all-gather needs of a split: one prompt's (DualChunkSplit) or a batch's (BatchSplit)."""

    @property
    def pcp_size(self) -> int: ...

    @property
    def max_local_tokens(self) -> int: ...

    @property
    def gather_index(self) -> torch.Tensor: ...


class KvAllGather:
    """The K/V exchange of one prefill: local K/V in, the whole prompt's K/V in position order out."""

    def __init__(
        self,
        split: GatherPlan,
        group: dist.ProcessGroup | HostGroup | None = None,
        on_progress: Callable[[], None] | None = None,
    ) -> None:
        """group: the PCP process group, or its shared-memory HostGroup (pcp_exchange_group); None: the
        default group."""
        self.split = split
        self.group = group
        # Each rank sends one buffer [2, width, kv_heads, head_dim] (its K rows, then its V rows, padded to
        # the widest share); gathered rank-major, rank r's local row i of K sits at r * 2 * width + i.
        width = split.max_local_tokens
        index = split.gather_index
        self._k_rows = index + (index // width) * width
        self._v_rows = self._k_rows + width
        # Called after every collective, so a node can tell a long prefill from a stuck group.
        self._on_progress = on_progress
        # A set of one rank holds the whole prompt's K/V, in position order: no collective, no copies.
        self._alone = split.pcp_size == 1 and torch.equal(index, torch.arange(len(index)))

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._alone:
            if self._on_progress is not None:
                self._on_progress()  # the node's watchdog still hears from every layer
            return k, v
        pcp, width = self.split.pcp_size, self.split.max_local_tokens
        n_local, kv_heads, head_dim = k.shape
        local = k.new_empty((2, width, kv_heads, head_dim))
        local[0, :n_local], local[1, :n_local] = k, v
        local[:, n_local:] = 0  # padding: sent, then dropped by the row indices
        if isinstance(self.group, HostGroup):
            gathered = self.group.all_gather(local.view(2 * width, kv_heads, head_dim))
            gathered = gathered.view(pcp * 2 * width, kv_heads, head_dim)
        else:
            gathered = k.new_empty((pcp * 2 * width, kv_heads, head_dim))
            # Into one buffer: no per-rank outputs to concatenate afterwards.
            dist.all_gather_into_tensor(gathered, local.view(2 * width, kv_heads, head_dim), group=self.group)
        if self._on_progress is not None:
            self._on_progress()
        # Rank-major padded shares -> [n, kv_heads, head_dim] each, in position order.
        k_rows, v_rows = self._k_rows.to(gathered.device), self._v_rows.to(gathered.device)
        return gathered.index_select(0, k_rows), gathered.index_select(0, v_rows)


def prefill_share(
    engine: Engine,
    state: SequenceState,
    token_ids: torch.Tensor,
    split: DualChunkSplit,
    pcp_rank: int,
    exchange: KvAllGather | None,
    start: int = 0,
    rope_len: int | None = None,
) -> torch.Tensor | None:
    """Runs this rank's share of `token_ids`, appended after the `start` tokens the sequence already holds
    (the same ones on every rank); fills the sequence's blocks with their K/V. A chunk of a longer prompt
    passes `rope_len`, the length the whole prompt brings the sequence to (dynamic RoPE rotates by it).

    token_ids: [n] the new tokens (every rank has them), split by `split` (of n tokens); `state` has blocks
    for start + n tokens. Returns the logits [vocab] after the last new token on the rank that computes it,
    None elsewhere.
    """
    n = split.num_tokens
    if len(token_ids) != n:
        raise ValueError(f"{len(token_ids)} new tokens but the split is of {n}")
    local = torch.tensor(split.positions(pcp_rank), dtype=torch.long)
    positions = local + start  # true positions, after the held prefix
    owner = split.last_position_owner() == pcp_rank
    with torch.inference_mode():
        logits = engine.forward_tokens(
            state,
            token_ids[local].tolist(),
            start=start,
            positions=positions,
            kv_positions=torch.arange(start, start + n),
            kv_exchange=exchange,
            logits_rows=(local == n - 1).nonzero().view(-1),
            rope_len=rope_len,
        )
    state.num_tokens = start + n
    return logits[0] if owner else None


def chunk_bounds(num_tokens: int, chunk_tokens: int) -> list[range]:
    """The chunks a prompt of num_tokens runs in: consecutive ranges of at most chunk_tokens (0: one)."""
    size = chunk_tokens if 0 < chunk_tokens < num_tokens else max(num_tokens, 1)
    return [range(s, min(s + size, num_tokens)) for s in range(0, num_tokens, size)]


def prefill_chunked(
    engine: Engine,
    state: SequenceState,
    token_ids: torch.Tensor,
    pcp_rank: int,
    pcp_size: int,
    chunk_tokens: int,
    exchange_for: Callable[[DualChunkSplit], KvAllGather | None],
    start: int = 0,
) -> torch.Tensor | None:
    """Prefills `token_ids` after the `start` tokens the sequence holds, in chunks of at most chunk_tokens
    (0: one chunk), each split over the PCP ranks by DualChunkSwap and attending to all before it.

    Chunking bounds a forward's activations (the attention scores grow with the chunk times the context);
    the K/V of the whole prompt still lands in every rank's cache. exchange_for(split) gives each chunk's
    K/V exchange (None: this is the only rank). Returns the logits [vocab] after the last token on the rank
    that computes it, None elsewhere.
    """
    logits = None
    for chunk in chunk_bounds(len(token_ids), chunk_tokens):
        split = DualChunkSplit(len(chunk), pcp_size)
        new = token_ids[chunk.start : chunk.stop]
        exchange, at = exchange_for(split), start + chunk.start
        # Every chunk rotates as the one forward over the whole prompt would (dynamic RoPE).
        logits = prefill_share(engine, state, new, split, pcp_rank, exchange, at, start + len(token_ids))
    return logits
