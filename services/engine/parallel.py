"""Tensor parallelism (TP) inside a context-parallel (PCP) set: the rank layout, the process groups, the
Megatron head/intermediate split of one TP rank, and the one collective the model calls.

A set of `tp_size × pcp_size` rank processes numbers its ranks `global = pcp_rank × tp_size + tp_rank`, the
layout vLLM uses: the TP ranks of one PCP rank are consecutive (they share a node and exchange the most
bytes), and one PCP group joins the ranks that hold the same TP shard. Every rank creates every group, in
the same order, because torch.distributed.new_group is itself a collective over the whole world.

The model is split Megatron-style. Attention: each TP rank owns `n_heads / T` query heads and the K/V heads
they read (when `T > n_kv_heads`, a K/V head is replicated on `T / n_kv_heads` ranks, as in vLLM); its slice
of the output projection gives a partial sum over heads. MLP: each rank owns `hidden_dim / T` of the
intermediate dimension (rounded: slices differ by at most one column when T does not divide it, e.g.
SmolLM2's 1536 at T = 9); its slice of the down projection gives a partial sum. `tensor_parallel_sum` adds the
partial sums over the TP group: one all-reduce after the attention output and one after the MLP. The
embedding, the norms and the LM head are replicated (every TP rank computes the full logits; with vocabularies
of SmolLM2's size a vocab split would save little and add a gather).

Collectives run on tensors on the group's device (gloo on the CPU, NCCL on CUDA, HCCL on Ascend).
`ParallelGroups.control` is a separate gloo group over the same world for control messages (a job's bytes,
the ranks' result shares, a decode step's command), so that on an accelerator they stay host tensors; on the
CPU it is the world group itself. Prefill ranks (prefill/rank.py) and the decode TP engine (tp_engine.py) send
all their control messages over it.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from pcpstack.engine.config import ModelArgs
from pcpstack.engine.host_group import HostGroup


def distributed_backend(device: torch.device | str) -> str:
    """hccl on NPUs (torch_npu), nccl on CUDA, gloo on CPU."""
    # A string, because torch.device("npu") only parses once torch_npu is imported.
    kind = device.split(":")[0] if isinstance(device, str) else device.type
    return {"npu": "hccl", "cuda": "nccl"}.get(kind, "gloo")


@dataclass(frozen=True)
class ParallelLayout:
    """The shape of a set: `tp_size` TP ranks in each of `pcp_size` PCP ranks."""

    tp_size: int
    pcp_size: int

    def __post_init__(self) -> None:
        for name in ("tp_size", "pcp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout.{name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        """Rank processes in the set."""
        return self.tp_size * self.pcp_size

    def global_rank(self, pcp_rank: int, tp_rank: int) -> int:
        """The rank in the set's world of TP rank `tp_rank` of PCP rank `pcp_rank`."""
        if not (0 <= pcp_rank < self.pcp_size and 0 <= tp_rank < self.tp_size):
            raise ValueError(f"(pcp_rank={pcp_rank}, tp_rank={tp_rank}) lies outside {self}")
        return pcp_rank * self.tp_size + tp_rank

    def coordinates(self, global_rank: int) -> tuple[int, int]:
        """(pcp_rank, tp_rank) of a global rank."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"global_rank={global_rank} lies outside a world of {self.world_size}")
        return divmod(global_rank, self.tp_size)

    def tp_group_ranks(self, pcp_rank: int) -> list[int]:
        """Global ranks of the TP group of one PCP rank (consecutive)."""
        return [self.global_rank(pcp_rank, t) for t in range(self.tp_size)]

    def pcp_group_ranks(self, tp_rank: int) -> list[int]:
        """Global ranks of the PCP group of one TP rank (stride tp_size)."""
        return [self.global_rank(p, tp_rank) for p in range(self.pcp_size)]


# The rule `TensorParallelShard.check` enforces, as configuration errors name it.
TP_SPLIT_RULE = (
    "the TP size divides the query heads, divides or is a multiple of the K/V heads, and is at most the "
    "intermediate size"
)


@dataclass(frozen=True)
class TensorParallelShard:
    """Which part of the model one TP rank holds: its query heads, K/V heads and intermediate slice.

    `group` is the TP process group the partial sums are added over (a HostGroup on a CPU decode worker). A
    model needs it when `size > 1`; the head ranges do not, so any process can compute another TP size's
    split (to reshard K/V by head range).
    The single-rank model (`size == 1`) has no group and no collective at all.
    """

    rank: int
    size: int
    group: dist.ProcessGroup | HostGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank={self.rank} must lie in [0, size={self.size})")

    def check(self, args: ModelArgs) -> None:
        """Refuses a model this TP size cannot split (TP_SPLIT_RULE), naming the numbers and the rule."""
        t = self.size
        if args.n_heads % t:
            raise ValueError(
                f"tensor_parallel_size={t} must divide the model's num_attention_heads={args.n_heads}"
            )
        if args.n_kv_heads % t and t % args.n_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={t} must divide num_key_value_heads={args.n_kv_heads} or be a "
                "multiple of it (K/V heads are then replicated)"
            )
        if args.hidden_dim < t:
            raise ValueError(f"tensor_parallel_size={t} must not exceed intermediate_size={args.hidden_dim}")

    def head_range(self, args: ModelArgs) -> range:
        """The query heads of this rank."""
        per_rank = args.n_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_head_range(self, args: ModelArgs) -> range:
        """The K/V heads of this rank: a slice, or one replicated head when T > n_kv_heads."""
        if self.size <= args.n_kv_heads:
            per_rank = args.n_kv_heads // self.size
            return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        head = self.rank // (self.size // args.n_kv_heads)
        return range(head, head + 1)

    def hidden_range(self, args: ModelArgs) -> range:
        """This rank's slice of the MLP's intermediate dimension (contiguous; the ranks' slices differ by at
        most one column when the size does not divide it: the partial sums are exact either way)."""
        return range(self.rank * args.hidden_dim // self.size, (self.rank + 1) * args.hidden_dim // self.size)

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The architecture this rank runs: the same model with its own heads and intermediate slice."""
        self.check(args)
        return replace(
            args,
            n_heads=len(self.head_range(args)),
            n_kv_heads=len(self.kv_head_range(args)),
            hidden_dim=len(self.hidden_range(args)),
        )


SINGLE_RANK = TensorParallelShard(0, 1)


def stored_kv_shards(args: ModelArgs, tp_size: int) -> list[tuple[int, range]]:
    """(tp_rank, K/V heads) of the shards a TP group stores as one replica: every K/V head once, from the
    first TP rank that holds it (with T > n_kv_heads the other holders of a head have the same bytes)."""
    shards: dict[int, tuple[int, range]] = {}
    for tp_rank in range(tp_size):
        heads = TensorParallelShard(tp_rank, tp_size).kv_head_range(args)
        shards.setdefault(heads.start, (tp_rank, heads))
    return [shards[start] for start in sorted(shards)]


def shard_fingerprint(fingerprint: str, heads: range, num_kv_heads: int) -> str:
    """The fingerprint a store object holding K/V heads `heads` of a replica is stored and read under.

    An object holding every head is the replica itself and keeps the replica's fingerprint; any narrower
    range gets a fingerprint of its own that names the range, so a reader asking for heads 0-1 is refused
    an object holding heads 2-3 even though both have the same shape."""
    if heads.start == 0 and heads.stop == num_kv_heads:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}/kv_heads={heads.start}:{heads.stop}".encode()).hexdigest()


def kv_fetch_plan(args: ModelArgs, source_tp_size: int, dest: TensorParallelShard) -> list[tuple[int, range]]:
    """Where rank `dest` finds its K/V heads in a replica stored by a TP group of `source_tp_size`:
    [(source tp_rank, heads)] in head order, each `heads` a sub-range of that stored shard's heads. A rank
    fetches only the heads it runs, whatever TP made the replica (resharding by head range)."""
    dest.check(args)
    wanted = dest.kv_head_range(args)
    plan = []
    for tp_rank, heads in stored_kv_shards(args, source_tp_size):
        start, stop = max(heads.start, wanted.start), min(heads.stop, wanted.stop)
        if start < stop:
            plan.append((tp_rank, range(start, stop)))
    return plan


def tensor_parallel_sum(partial: torch.Tensor, group: dist.ProcessGroup | HostGroup | None) -> torch.Tensor:
    """The tensor-parallel step: the sum over the TP group of each rank's partial projection.

    Called after the attention output projection and after the MLP down projection. With no group (a
    single-rank model) it returns its input untouched: no collective, no copy. A HostGroup (the CPU decode
    TP group, engine.host_group) sums through shared memory.
    """
    if group is None:
        return partial
    if isinstance(group, HostGroup):
        return group.all_reduce_sum(partial)
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return partial


@dataclass(frozen=True)
class ParallelGroups:
    """One rank's place in its set and the process groups it takes part in."""

    layout: ParallelLayout
    global_rank: int
    tp_group: dist.ProcessGroup
    pcp_group: dist.ProcessGroup
    control: dist.ProcessGroup

    @property
    def pcp_rank(self) -> int:
        """This rank's PCP rank (which DualChunkSwap share it runs)."""
        return self.layout.coordinates(self.global_rank)[0]

    @property
    def tp_rank(self) -> int:
        """This rank's TP rank (which heads and intermediate slice it holds)."""
        return self.layout.coordinates(self.global_rank)[1]

    def shard(self) -> TensorParallelShard:
        """The model shard of this rank; the single-rank model (no group, no collective) when tp_size is 1."""
        if self.layout.tp_size == 1:
            return SINGLE_RANK
        return TensorParallelShard(self.tp_rank, self.layout.tp_size, self.tp_group)


def init_parallel_groups(
    layout: ParallelLayout,
    global_rank: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    timeout_seconds: float,
) -> ParallelGroups:
    """Joins this process to its set's world (tcp:// rendezvous at the master) and builds its groups.

    Every rank calls new_group for every TP group, then every PCP group, then the control group, in that
    order: group creation is collective over the world, so a rank that skipped one would hang the others.
    """
    backend = distributed_backend(device)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=global_rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    pcp_rank, tp_rank = layout.coordinates(global_rank)
    tp_groups = [dist.new_group(layout.tp_group_ranks(p), timeout=timeout) for p in range(layout.pcp_size)]
    pcp_groups = [dist.new_group(layout.pcp_group_ranks(t), timeout=timeout) for t in range(layout.tp_size)]
    control = dist.group.WORLD
    if backend != "gloo":
        control = dist.new_group(list(range(layout.world_size)), backend="gloo", timeout=timeout)
    return ParallelGroups(layout, global_rank, tp_groups[pcp_rank], pcp_groups[tp_rank], control)
