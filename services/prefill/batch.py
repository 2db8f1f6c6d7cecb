"""Batched prefill on one PCP rank: several sequences' new tokens in one forward.

A burst of short prompts should not queue one forward each. Here each sequence's new tokens are split over
the PCP ranks by DualChunkSwap on their own (so every sequence's causal work stays balanced), and a rank runs
the concatenation of its shares of all sequences, each token at its own sequence's true position (RoPE). The
per-layer K/V exchange is the same `KvAllGather` as for one prompt, driven by a `BatchSplit` that knows where
every sequence's rows land; every rank then writes each sequence's K/V into that sequence's blocks (a complete
replica of every sequence), and attention keeps each sequence's queries to its own context (its held prefix
and its new tokens, causally): engine.attention's `query_lens`. The rank holding a sequence's last new
token computes that sequence's logits.

With one sequence this is `prefill_share`; the arithmetic per sequence is the same, so the result equals
prefilling the sequences one by one.

The serving side: `jobs_in_batch` decides how many waiting jobs a set takes at once (the node), and
`pack_jobs`/`unpack_jobs` carry them in one broadcast to every rank.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from pcpstack.engine.attention import AttentionMetadata
from pcpstack.engine.engine import Engine, SequenceState
from pcpstack.engine.kv_cache import blocks_needed, slots_for
from pcpstack.prefill.context_parallel import KvAllGather
from pcpstack.prefill.job import PrefillJob
from pcpstack.prefill.split import DualChunkSplit

# Prompt tokens past which one forward gains nothing from batching, so a batch stops there (a longer prompt
# runs alone). Measured on SmolLM2-135M, one thread per rank, single rank: 16 prompts of 32 tokens in one
# forward took 1.6 s against 4.8 s one by one, 8 of 128 tokens 5.7 s against 9.5 s, and 4 of 512 tokens
# 11.1 s against 10.7 s. Past it a batch only delays its first jobs' first tokens: on an AMD EPYC without
# AVX-512 (3 Dec), 2 and 4 prompts of 512 tokens in one forward took 95.6 and 95.9 % of their CPU one by one,
# so 16 such prompts two a forward would give a TTFT p50 of 4.5 x 1.91 = 8.6 forwards' time against 8.5.
BATCH_TOKENS = 512
_COUNT = struct.Struct("<q")


def jobs_in_batch(
    prompt_lengths: Sequence[int], max_jobs: int, max_tokens: int, capacity_blocks: int, block_size: int
) -> int:
    """How many of the waiting jobs (prompt_lengths, oldest first) to run in one forward: the oldest always
    (alone it runs as today, in chunks if need be), then the next ones in order while there are at most
    max_jobs, their prompts hold at most max_tokens together, and their blocks fit in the rank's cache
    (every rank holds every sequence of the batch at once). In order only, so no job is overtaken."""
    count, tokens, blocks = 1, prompt_lengths[0], blocks_needed(prompt_lengths[0], block_size)
    for length in prompt_lengths[1:max_jobs]:
        tokens, blocks = tokens + length, blocks + blocks_needed(length, block_size)
        if tokens > max_tokens or blocks > capacity_blocks:
            break
        count += 1
    return count


def pack_jobs(jobs: Sequence[PrefillJob]) -> torch.Tensor:
    """Several jobs as one uint8 tensor for the rank broadcast: their count, each one's size, their bytes."""
    encoded = [job.to_bytes() for job in jobs]
    head = b"".join(_COUNT.pack(n) for n in (len(encoded), *(len(e) for e in encoded)))
    return torch.frombuffer(bytearray(head + b"".join(encoded)), dtype=torch.uint8)


def unpack_jobs(tensor: torch.Tensor) -> list[PrefillJob]:
    """The jobs a pack_jobs broadcast delivered, in order."""
    view = memoryview(tensor.numpy().tobytes())
    (count,) = _COUNT.unpack_from(view, 0)
    sizes = [_COUNT.unpack_from(view, _COUNT.size * (1 + i))[0] for i in range(count)]
    offset, jobs = _COUNT.size * (1 + count), []
    for size in sizes:
        jobs.append(PrefillJob.from_bytes(view[offset : offset + size]))
        offset += size
    return jobs


@dataclass(frozen=True)
class BatchSplit:
    """The DualChunkSwap splits of several sequences' new tokens (`lengths`) over pcp_size ranks.

    A rank's local tokens are its share of sequence 0, then its share of sequence 1, and so on. The K/V
    all-gather returns the new tokens of sequence 0 in position order, then those of sequence 1, and so on.
    """

    lengths: tuple[int, ...]
    pcp_size: int

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("a batch needs at least one sequence")

    @cached_property
    def splits(self) -> tuple[DualChunkSplit, ...]:
        """Each sequence's own split (validates every length)."""
        return tuple(DualChunkSplit(n, self.pcp_size) for n in self.lengths)

    @property
    def num_tokens(self) -> int:
        """New tokens of all sequences together."""
        return sum(self.lengths)

    def local_counts(self, pcp_rank: int) -> list[int]:
        """How many new tokens of each sequence rank pcp_rank computes."""
        return [len(split.positions(pcp_rank)) for split in self.splits]

    @cached_property
    def max_local_tokens(self) -> int:
        """Largest rank's share of the whole batch; every rank pads to it for the all-gather."""
        return max(sum(self.local_counts(r)) for r in range(self.pcp_size))

    @cached_property
    def gather_index(self) -> torch.Tensor:
        """[num_tokens] row of each sequence's each new token (sequence-major, position order) in the
        concatenation of all ranks' padded batch shares (rank-major)."""
        width = self.max_local_tokens
        # Where each sequence's share starts inside each rank's batch share.
        offsets = torch.zeros(self.pcp_size, dtype=torch.long)
        rows = []
        for split in self.splits:
            # split.gather_index addresses shares padded to the sequence's own widest: rank * w + local.
            own = split.gather_index
            rank = own // split.max_local_tokens
            rows.append(rank * width + offsets[rank] + own % split.max_local_tokens)
            offsets += torch.tensor([len(split.positions(r)) for r in range(self.pcp_size)])
        return torch.cat(rows)


def prefill_batch(
    engine: Engine,
    states: Sequence[SequenceState],
    token_ids: Sequence[torch.Tensor],
    split: BatchSplit,
    pcp_rank: int,
    exchange: KvAllGather | None,
    starts: Sequence[int] | None = None,
) -> list[torch.Tensor | None]:
    """Runs this rank's shares of several sequences in one forward, each sequence's new tokens appended
    after the starts[i] tokens it already holds (the same on every rank; default none); fills every
    sequence's blocks with its K/V.

    token_ids[i]: [lengths[i]] sequence i's new tokens (every rank has them); states[i] has blocks for
    starts[i] + lengths[i] tokens. Returns, per sequence, the logits [vocab] after its last new token on the
    rank that computes them, None elsewhere.
    """
    starts = list(starts) if starts is not None else [0] * len(states)
    if not len(states) == len(token_ids) == len(starts) == len(split.lengths):
        raise ValueError(
            f"{len(states)} states, {len(token_ids)} token lists and {len(starts)} starts for a split of "
            f"{len(split.lengths)} sequences"
        )
    for i, (ids, n) in enumerate(zip(token_ids, split.lengths, strict=True)):
        if len(ids) != n:
            raise ValueError(f"sequence {i} has {len(ids)} new tokens but the split is of {n}")
    device = engine.device
    local_ids, positions, slots, logits_rows = [], [], [], []
    width = max(len(state.block_table) for state in states)
    tables = []
    for ids, seq_split, state, start in zip(token_ids, split.splits, states, starts, strict=True):
        local = torch.tensor(seq_split.positions(pcp_rank), dtype=torch.long)
        if seq_split.last_position_owner() == pcp_rank:
            logits_rows.append(sum(len(p) for p in positions) + len(local) - 1)
        local_ids.append(ids[local])
        positions.append(local + start)  # true positions, after the held prefix
        table = torch.tensor(state.block_table, dtype=torch.long)
        slots.append(slots_for(table, torch.arange(start, start + seq_split.num_tokens), engine.block_size))
        # Padding entries point at block 0; attention reads only each sequence's context.
        tables.append(state.block_table + [0] * (width - len(state.block_table)))
    context_lens = [start + n for start, n in zip(starts, split.lengths, strict=True)]
    all_positions = torch.cat(positions).to(device)
    meta = AttentionMetadata(
        positions=all_positions,
        slot_mapping=torch.cat(slots).to(device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        max_context_len=max(context_lens),
        kv_exchange=exchange,
        query_lens=split.local_counts(pcp_rank),
    )
    rows = torch.tensor(logits_rows, dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = engine.model(torch.cat(local_ids).to(device), all_positions, engine.cache, meta, rows)
    for state, context in zip(states, context_lens, strict=True):
        state.num_tokens = context
    owned = iter(logits)
    return [
        next(owned) if seq_split.last_position_owner() == pcp_rank else None for seq_split in split.splits
    ]
