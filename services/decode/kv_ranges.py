"""Which bytes of a replica's store objects one decode rank needs, as ranged reads, and how they fit back.

A replica shard is one store object [layers, 2, tokens, its K/V heads, head_dim] (row-major, the layout's
dtype). A rank of a decode context-parallel (DCP) worker stores only its K/V heads (`KvPart.kv_heads`) at its
token positions (`KvPart.positions`: one run per block, block b on DCP rank b % D). Runs of equal length at
equal spacing fold into one strided range per (shard, fold): the rank's full blocks of every (layer, K/V)
plane are one range and a short last block a second, instead of one read per block and plane. When the rank
needs only some of a shard's heads, each token row contributes its heads' slice (one more repeat level).

`part_reads` plans the reads of one part; `assemble_part` turns the bytes they returned into the part's
tensor [layers, 2, part tokens, part heads, head_dim] that engine.adopt_parts takes. Plain Python: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
class ShardRead:
    """One ranged Get of a part: ranges of one store object, the heads they hold, each range's tokens."""

    shard_index: int
    kv_heads: range  # of the whole model; a sub-range of both the shard's and the part's
    ranges: tuple[ByteRange, ...]
    tokens: tuple[int, ...]  # tokens each range holds, in order


def part_reads(
    part: KvPart, shard_heads: Sequence[range], num_tokens: int, layout: KvLayout
) -> list[ShardRead]:
    """The ranged reads that fetch `part` from a replica of `num_tokens` tokens whose store objects hold
    the K/V heads `shard_heads` (in head order), one read per object the part's heads overlap."""
    itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
    head_bytes = layout.head_dim * itemsize
    planes = layout.num_layers * 2
    folds = fold_runs([run for run in part.positions if len(run)])
    if not folds:  # a sequence shorter than the rank's first block: nothing to read (no ranges = everything)
        return []
    reads = []
    for index, heads in enumerate(shard_heads):
        first, stop = max(heads.start, part.kv_heads.start), min(heads.stop, part.kv_heads.stop)
        if first >= stop:
            continue
        row = len(heads) * head_bytes  # one token of the object's heads
        plane = num_tokens * row
        whole_rows = (first, stop) == (heads.start, heads.stop)
        ranges = []
        for fold in folds:
            repeats = [ByteRepeat(plane, planes), ByteRepeat(fold.spacing * row, fold.count)]
            if whole_rows:  # a run of whole rows is contiguous
                length = fold.length * row
            else:  # each row gives the slice of the part's heads
                length = (stop - first) * head_bytes
                repeats.append(ByteRepeat(row, fold.length))
            offset = fold.start * row + (first - heads.start) * head_bytes
            ranges.append(ByteRange(offset, length, tuple(repeats)))
        reads.append(ShardRead(index, range(first, stop), tuple(ranges), tuple(f.num_tokens for f in folds)))
    return reads


def assemble_part(
    part: KvPart, reads: Sequence[ShardRead], data: Sequence[memoryview], layout: KvLayout
) -> torch.Tensor:
    """The part [layers, 2, part tokens, part heads, head_dim] from what each read returned (data[i] for
    reads[i]: its ranges' bytes, range after range)."""
    pieces = []
    for read, raw in zip(reads, data, strict=True):
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(layout.torch_dtype) if len(raw) else None
        runs, at = [], 0
        for tokens in read.tokens:
            count = layout.num_layers * 2 * tokens * len(read.kv_heads) * layout.head_dim
            shape = (layout.num_layers, 2, tokens, len(read.kv_heads), layout.head_dim)
            runs.append(flat[at : at + count].view(shape))
            at += count
        pieces.append(torch.cat(runs, dim=2) if len(runs) != 1 else runs[0])
    if not pieces:
        return torch.empty(
            (layout.num_layers, 2, part.num_tokens, len(part.kv_heads), layout.head_dim),
            dtype=layout.torch_dtype,
        )
    return torch.cat(pieces, dim=3) if len(pieces) != 1 else pieces[0]
