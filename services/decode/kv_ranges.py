"""Which bytes of a replica's store objects one decode rank needs, as ranged reads, and how they fit back.

A replica shard is one store object [layers, 2, tokens, its K/V heads, head_dim] (row-major, the layout's
dtype). A rank of a decode context-parallel (DCP) worker stores only its K/V heads (`KvPart.kv_heads`) at its
token positions (`KvPart.positions`: one run per block, block b on DCP rank b % D). Runs of equal length at
equal spacing fold into one strided range per (shard, fold): the rank's full blocks of every (layer, K/V)
plane are one range and a short last block a second, instead of one read per block and plane. When the rank
needs only some of a shard's heads, each token row contributes its heads' slice (one more repeat level).

With a cached prefix the sequence's tokens live in several objects one after another (`KvSource`: the
prefix's runs, then the new tokens' shards); a part's reads are planned per object over the window of
positions it holds. A prefix made by a TP prefill set is stored per K/V head range, and each range's runs
may end at other tokens (its blocks were first offered by other requests): `prefix_sources` cuts them at
one another's ends, so every window of positions is covered by one source per head range. `part_reads`
plans the reads of one part; `assemble_part` turns the bytes they returned into the part's tensor
[layers, 2, part tokens, part heads, head_dim] that engine.adopt_parts takes. Plain Python: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pcpstack.engine.dcp import KvPart
from pcpstack.engine.kv_cache import KvLayout
from pcpstack.kvstore.ranges import ByteRange, ByteRepeat


@dataclass(frozen=True)
class RunFold:
    """`count` runs of `length` tokens, the first at token `start`, each `spacing` tokens after the last."""

    start: int
    length: int
    spacing: int
    count: int

    @property
    def num_tokens(self) -> int:
        """Tokens the fold covers."""
        return self.length * self.count


def fold_runs(runs: Sequence[range]) -> list[RunFold]:
    """The runs (in order, non-empty) as few folds as keep their order: consecutive runs of one length at one
    spacing share a fold."""
    folds: list[RunFold] = []
    for run in runs:
        last = folds[-1] if folds else None
        if last is not None and len(run) == last.length:
            spacing = run.start - (last.start + (last.count - 1) * last.spacing)
            if last.count == 1 and spacing > 0:
                folds[-1] = RunFold(last.start, last.length, spacing, 2)
                continue
            if spacing == last.spacing:
                folds[-1] = RunFold(last.start, last.length, last.spacing, last.count + 1)
                continue
        folds.append(RunFold(run.start, len(run), 0, 1))
    return folds


@dataclass(frozen=True)
class KvSource:
    """Where a window of the sequence's tokens lives: positions [start, start + count) are tokens
    [offset, offset + count) of one store object [layers, 2, object_tokens, heads, head_dim]. A replica read
    whole has one source per shard; with a cached prefix, its runs come first (a run of an earlier
    request's object, all K/V heads, from its token `offset`) and the new tokens' shards after them."""

    start: int
    count: int
    heads: range  # the object's K/V heads, of the whole model
    object_tokens: int
    offset: int = 0


def prefix_sources(
    runs: Sequence[KvSource], num_kv_heads: int, num_tokens: int
) -> list[tuple[int, KvSource]]:
    """The cached prefix's runs (each head range's in sequence order, their `start`s ignored) as sources
    over common windows: (index of the run in `runs`, source) by window, then by heads. ValueError when
    the head ranges do not split every K/V head or a range's runs do not hold num_tokens tokens."""
    by_heads: dict[tuple[int, int], list[int]] = {}
    for index, run in enumerate(runs):
        by_heads.setdefault((run.heads.start, run.heads.stop), []).append(index)
    at = 0
    for start, stop in sorted(by_heads):
        if start != at:
            raise ValueError(f"the prefix's K/V head ranges leave heads {at}-{start} uncovered or twice")
        at = stop
    if at != num_kv_heads:
        raise ValueError(f"the prefix's K/V head ranges end at head {at}, not {num_kv_heads}")
    placed: list[tuple[int, KvSource]] = []  # each run at its position in the sequence
    for indices in by_heads.values():
        position = 0
        for index in indices:
            placed.append((index, replace(runs[index], start=position)))
            position += runs[index].count
        if position != num_tokens:
            heads = runs[indices[0]].heads
            raise ValueError(
                f"the prefix of K/V heads {heads.start}-{heads.stop} holds {position} tokens, not "
                f"{num_tokens}"
            )
    cuts = sorted({source.start for _, source in placed})
    windows = []
    for index, source in placed:
        end = source.start + source.count
        inner = [cut for cut in cuts if source.start < cut < end]
        for first, stop in zip([source.start, *inner], [*inner, end], strict=True):
            piece = replace(
                source, start=first, count=stop - first, offset=source.offset + first - source.start
            )
            windows.append((index, piece))
    return sorted(windows, key=lambda item: (item[1].start, item[1].heads.start))


def shard_sources(shard_heads: Sequence[range], num_tokens: int, start: int = 0) -> list[KvSource]:
    """The sources of a replica's shards holding `num_tokens` tokens from position `start`, by heads."""
    return [KvSource(start, num_tokens, heads, num_tokens) for heads in shard_heads]


@dataclass(frozen=True)
class ShardRead:
    """One ranged Get of a part: ranges of one store object (sources[shard_index]), the heads they hold,
    each range's tokens."""

    shard_index: int
    kv_heads: range  # of the whole model; a sub-range of both the source's and the part's
    ranges: tuple[ByteRange, ...]
    tokens: tuple[int, ...]  # tokens each range holds, in order
    window: int = 0  # the first sequence position of the source: reads of one window share their tokens


def part_reads(part: KvPart, sources: Sequence[KvSource], layout: KvLayout) -> list[ShardRead]:
    """The ranged reads that fetch `part` from the store objects `sources` describe (in sequence order, by
    heads within a window), one read per object whose window and heads the part overlaps."""
    itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
    head_bytes = layout.head_dim * itemsize
    planes = layout.num_layers * 2
    reads = []
    for index, source in enumerate(sources):
        first, stop = max(source.heads.start, part.kv_heads.start), min(source.heads.stop, part.kv_heads.stop)
        if first >= stop:
            continue
        end = source.start + source.count
        # the part's runs inside the window, in the object's own token numbering
        shift = source.offset - source.start
        inside = [range(max(r.start, source.start) + shift, min(r.stop, end) + shift) for r in part.positions]
        folds = fold_runs([run for run in inside if len(run)])
        if not folds:
            continue
        row = len(source.heads) * head_bytes  # one token of the object's heads
        plane = source.object_tokens * row
        whole_rows = (first, stop) == (source.heads.start, source.heads.stop)
        ranges = []
        for fold in folds:
            repeats = [ByteRepeat(plane, planes), ByteRepeat(fold.spacing * row, fold.count)]
            if whole_rows:  # a run of whole rows is contiguous
                length = fold.length * row
            else:  # each row gives the slice of the part's heads
                length = (stop - first) * head_bytes
                repeats.append(ByteRepeat(row, fold.length))
            offset = fold.start * row + (first - source.heads.start) * head_bytes
            ranges.append(ByteRange(offset, length, tuple(repeats)))
        tokens = tuple(f.num_tokens for f in folds)
        reads.append(ShardRead(index, range(first, stop), tuple(ranges), tokens, source.start))
    return reads


def assemble_part(
    part: KvPart, reads: Sequence[ShardRead], data: Sequence[memoryview], layout: KvLayout
) -> torch.Tensor:
    """The part [layers, 2, part tokens, part heads, head_dim] from what each read returned (data[i] for
    reads[i]: its ranges' bytes, range after range): the reads of one window side by side by heads, the
    windows one after another."""
    windows: dict[int, list[torch.Tensor]] = {}
    for read, raw in zip(reads, data, strict=True):
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(layout.torch_dtype) if len(raw) else None
        runs, at = [], 0
        for tokens in read.tokens:
            count = layout.num_layers * 2 * tokens * len(read.kv_heads) * layout.head_dim
            shape = (layout.num_layers, 2, tokens, len(read.kv_heads), layout.head_dim)
            runs.append(flat[at : at + count].view(shape))
            at += count
        windows.setdefault(read.window, []).append(torch.cat(runs, dim=2) if len(runs) != 1 else runs[0])
    if not windows:
        return torch.empty(
            (layout.num_layers, 2, part.num_tokens, len(part.kv_heads), layout.head_dim),
            dtype=layout.torch_dtype,
        )
    pieces = [
        torch.cat(by_heads, dim=3) if len(by_heads) != 1 else by_heads[0] for by_heads in windows.values()
    ]
    return torch.cat(pieces, dim=2) if len(pieces) != 1 else pieces[0]
