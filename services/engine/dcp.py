"""Decode context parallelism (DCP): a sequence's K/V split by token blocks over the D ranks of a DCP group.

The ranks of one DCP group are D consecutive TP ranks that hold the same K/V head(s) (kv-head replication
when T > n_kv_heads). Instead of each storing every token of those heads, token block b (positions
[b*I, (b+1)*I), I the block size, which is also the interleave size) lives only on DCP rank b % D. A rank
packs its blocks densely: the local position of global position p is (p // (I*D)) * I + p % I, so its local
block j holds global block j*D + rank and a rank needs about 1/D of the blocks.

A decode step then runs attention in three moves (`dcp_decode_attention`): all-gather the queries of the
group's ranks (their query heads share the K/V head), attend them to the rank's own blocks keeping each
row's log-sum-exp, all-gather those partial results and combine them exactly with
`merge_partial_attention`; each rank keeps the rows of its own query heads. The new token's K/V is computed
on every rank of the group but written only by the rank that owns its block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pcpstack.engine.host_group import HostGroup
from pcpstack.engine.kv_cache import blocks_needed

if TYPE_CHECKING:
    from pcpstack.engine.attention import AttentionMetadata


@dataclass(frozen=True)
class DcpShard:
    """Which token blocks of every sequence one DCP rank stores: block b when b % size == rank.

    `group` is the DCP process group (or the shared-memory HostGroup of a CPU decode worker) the queries and
    partial attentions are gathered over; the arithmetic does not need it, so any process can compute another
    rank's share (to slice a replica for it).
    """

    rank: int
    size: int
    block_size: int
    group: dist.ProcessGroup | HostGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"decode context parallel rank={self.rank} must lie in [0, size={self.size})")
        if self.block_size <= 0:
            raise ValueError(f"DcpShard.block_size={self.block_size} must be > 0")

    @property
    def _stride(self) -> int:
        # Global tokens per round of the D ranks' blocks.
        return self.block_size * self.size

    def owns(self, position: int) -> bool:
        """Whether the token at global `position` is stored on this rank."""
        return (position // self.block_size) % self.size == self.rank

    def local_index(self, position: int) -> int:
        """The local position of an owned global `position` in this rank's dense share."""
        return (position // self._stride) * self.block_size + position % self.block_size

    def local_count(self, num_tokens: int) -> int:
        """How many of a sequence's first `num_tokens` tokens this rank stores."""
        rounds, rest = divmod(num_tokens, self._stride)
        return rounds * self.block_size + min(max(rest - self.rank * self.block_size, 0), self.block_size)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks this rank needs for a sequence of `num_tokens` tokens."""
        return blocks_needed(self.local_count(num_tokens), self.block_size)

    def owned_runs(self, num_tokens: int) -> tuple[range, ...]:
        """The global positions below `num_tokens` this rank stores, one run per block, in order."""
        size, first = self.block_size, self.rank * self.block_size
        return tuple(
            range(start, min(start + size, num_tokens)) for start in range(first, num_tokens, self._stride)
        )

    def owned_positions(self, num_tokens: int) -> torch.Tensor:
        """[local_count(num_tokens)] the global positions this rank stores, in order (its local order)."""
        runs = self.owned_runs(num_tokens)
        if not runs:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([torch.arange(run.start, run.stop) for run in runs])


@dataclass(frozen=True)
class KvPart:
    """The share of a sequence's K/V one TP rank stores: the whole model's K/V heads `kv_heads` at the global
    token positions `positions` (runs of at most one block each, in order)."""

    tp_rank: int
    kv_heads: range
    positions: tuple[range, ...]

    @property
    def num_tokens(self) -> int:
        """How many token positions the part holds."""
        return sum(len(run) for run in self.positions)


@dataclass(frozen=True)
class DcpStep:
    """What a DCP rank's decode step adds to the attention metadata: its shard (with the group) and which of
    the step's tokens it writes (`write_rows`, indices into the step's rows; `slot_mapping` holds their
    local slots)."""

    shard: DcpShard
    write_rows: torch.Tensor


def merge_partial_attention(outputs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact attention over the union of D disjoint key sets from the attention over each set.

    outputs: [D, ..., head_dim], each the softmax-weighted values over one key set; lses: [D, ...] the
    log-sum-exp of that set's scores (-inf for a set with no keys: its output may be anything, even NaN,
    and gets weight 0). The softmax over all keys reweights set d by exp(lse_d - logsumexp_d(lse_d)).
    Returns [..., head_dim] in float32; a row with no keys at all is 0.
    """
    lses = lses.float()
    total = torch.logsumexp(lses, dim=0)
    # A row no set has keys for: weight 0 everywhere instead of exp(-inf - -inf) = NaN.
    weights = torch.exp(lses - total.masked_fill(torch.isinf(total), 0.0))
    has_keys = torch.isfinite(lses)[..., None]
    parts = torch.where(has_keys, outputs.float(), 0.0) * weights[..., None]
    return parts.sum(dim=0)


def attention_with_lse(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row per (sequence, head) against the first `key_counts[b]` keys of its sequence.

    q: [B, kv_heads, G, D] (G query heads per K/V head); keys, values: [B, ctx, kv_heads, D]; key_counts:
    [B]. Returns out [B, kv_heads, G, D] and lse [B, kv_heads, G] in float32; a sequence with no keys gets
    lse -inf and out 0.
    """
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("bhgd,bchd->bhgc", q.float(), keys.float()) * scale
    visible = torch.arange(keys.shape[1], device=q.device) < key_counts.view(-1, 1)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.einsum("bhgc,bchd->bhgd", probs, values.float())
    return out, lse


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | HostGroup, size: int) -> torch.Tensor:
    """[size, *tensor.shape]: every rank's tensor in DCP rank order."""
    if isinstance(group, HostGroup):
        return group.all_gather(tensor)
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return torch.stack(gathered)


def dcp_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    step: DcpStep,
) -> torch.Tensor:
    """A DCP rank's decode attention: write the step's owned K/V rows, attend the whole group's queries to
    this rank's blocks, merge the group's partial results, keep this rank's heads.

    q: [B, n_heads, head_dim] (one token per sequence, this rank's query heads); k, v: [B, kv_heads,
    head_dim]; caches [num_blocks, block_size, kv_heads, head_dim] holding this rank's blocks. `meta`
    carries the local slots of `step.write_rows`, the local block tables and each sequence's local key
    count. Returns [B, n_heads * head_dim].
    """
    shard = step.shard
    n_kv_heads, head_dim = k_cache.shape[2:]
    if step.write_rows.numel():
        k_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k[step.write_rows])
        v_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v[step.write_rows])

    batch, n_heads, _ = q.shape
    # The group's query heads, rank by rank: consecutive TP ranks hold consecutive heads of the K/V head(s).
    group_q = _all_gather(q, shard.group, shard.size).permute(1, 0, 2, 3)  # [B, size, n_heads, head_dim]
    group_heads = shard.size * n_heads
    group_q = group_q.reshape(batch, n_kv_heads, group_heads // n_kv_heads, head_dim)

    blocks = meta.block_tables.flatten()
    shape = (batch, -1, n_kv_heads, head_dim)
    keys = k_cache.index_select(0, blocks).view(shape)[:, : meta.max_context_len]
    values = v_cache.index_select(0, blocks).view(shape)[:, : meta.max_context_len]
    out, lse = attention_with_lse(group_q, keys, values, meta.context_lens)
    # One gather for both: [B, kv_heads, G, head_dim + 1].
    partial = torch.cat([out, lse[..., None]], dim=-1)
    gathered = _all_gather(partial, shard.group, shard.size)
    merged = merge_partial_attention(gathered[..., :head_dim], gathered[..., head_dim])
    mine = merged.reshape(batch, group_heads, head_dim)[:, shard.rank * n_heads : (shard.rank + 1) * n_heads]
    return mine.to(q.dtype).reshape(batch, n_heads * head_dim)
