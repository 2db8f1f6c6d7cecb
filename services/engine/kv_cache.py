"""Paged KV cache: fixed-size blocks, a block allocator, slot arithmetic, and replica export/import.

Each layer keeps K and V as [num_blocks, block_size, n_kv_heads, head_dim]; grouped-query attention reads the
shared K/V heads directly, never a per-query-head copy. A `KvLayout` fingerprint lets other services refuse
KV bytes produced by a different model, dtype or block size.
"""

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from pcpstack.common.config import ConfigError
from pcpstack.engine.config import ModelArgs
from pcpstack.engine.device import dtype_name


class OutOfBlocksError(RuntimeError):
    """The cache has fewer free blocks than a request needs."""


@dataclass(frozen=True)
class KvLayout:
    """Everything that must match for KV bytes from one process to be valid in another."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"KvLayout.block_size={self.block_size} must be > 0")

    @classmethod
    def for_model(cls, model_id: str, args: ModelArgs, dtype: torch.dtype, block_size: int) -> "KvLayout":
        """The layout of a model's KV cache at a dtype and block size."""
        return cls(model_id, args.n_layers, args.n_kv_heads, args.head_dim, dtype_name(dtype), block_size)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take in every layer."""
        element = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    @property
    def torch_dtype(self) -> torch.dtype:
        """The layout's dtype as a torch dtype."""
        return getattr(torch, self.dtype)

    def fingerprint(self) -> str:
        """sha256 hex of the layout; identical in every process that uses the same model and settings."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def check_cache_fits(flag: str, tokens: int, layout: KvLayout, copies: int, device_kind: str) -> None:
    """Refuses a K/V cache of `tokens` tokens (`copies` of it on this node: each PCP rank keeps its own)
    that this machine's memory could not hold even alone: ConfigError naming the flag, rather than a
    process the kernel kills as it fills the cache. On the CPU only; an accelerator's allocator reports
    its own shortage."""
    if device_kind != "cpu":
        return
    need = tokens * layout.bytes_per_token * copies
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory:
        rule = (
            f"needs {need / 2**30:.1f} GiB of K/V cache on this node ({copies} x {tokens} tokens x "
            f"{layout.bytes_per_token} bytes), more than its {memory / 2**30:.1f} GiB of memory"
        )
        raise ConfigError.broken(flag, tokens, rule)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def slots_for(
    block_table: torch.Tensor | Sequence[int], positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat cache slots (block * block_size + offset) of token `positions` in a sequence's block table."""
    table = torch.as_tensor(block_table, dtype=torch.long, device=positions.device)
    if positions.numel() and int(positions.max()) >= table.numel() * block_size:
        raise ValueError(
            f"position {int(positions.max())} lies beyond the block table ({table.numel()} blocks of "
            f"{block_size} tokens)"
        )
    return table[positions // block_size] * block_size + positions % block_size


class BlockAllocator:
    """Hands out cache block ids; refuses clearly when none are left or a block is freed twice."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        self.num_blocks = num_blocks
        # Popped from the end, so low block ids go out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks not handed out."""
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free block ids, or OutOfBlocksError without taking any."""
        if count > len(self._free):
            raise OutOfBlocksError(
                f"KV cache out of blocks: need {count}, {len(self._free)} free of {self.num_blocks}"
            )
        blocks = [self._free.pop() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Return blocks to the pool; a block that is not allocated is an error (double free)."""
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"block {block} is not allocated (double free?)")
        # Pushed back in reverse, so the next allocation pops them in ascending order: a sequence's blocks
        # then run forward through memory, which decode attention streams faster than a descending table.
        for block in reversed(blocks):
            self._used.remove(block)
            self._free.append(block)


class PagedKVCache:
    """K and V of all layers in blocks: one tensor [layers, 2, blocks, block_size, kv_heads, dim]."""

    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.data = torch.zeros(
            layout.num_layers,
            2,
            num_blocks,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
            dtype=layout.torch_dtype,
            device=device,
        )

    @property
    def device(self) -> torch.device:
        """Where the cache lives."""
        return self.data.device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [num_blocks, block_size, kv_heads, head_dim] (views)."""
        return self.data[index, 0], self.data[index, 1]

    def _flat(self) -> torch.Tensor:
        # [layers, 2, num_blocks * block_size, kv_heads, head_dim]: a view addressed by slot.
        return self.data.flatten(2, 3)

    def export_sequence(self, block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
        """A sequence's KV replica: one contiguous [layers, 2, num_tokens, kv_heads, head_dim] tensor."""
        slots = slots_for(block_table, torch.arange(num_tokens, device=self.device), self.block_size)
        return self._flat().index_select(2, slots)

    def sequence_pieces(
        self, block_table: Sequence[int], num_tokens: int, start: int = 0
    ) -> list[torch.Tensor]:
        """The bytes `export_sequence(...)[:, :, start:]` would hold, as views of the cache in that order
        (one contiguous [tokens, kv_heads, head_dim] piece per layer, K/V and run of consecutive block ids)
        rather than one gathered tensor: a writer that takes pieces sends the replica without a staging
        copy. A sequence whose blocks were allocated in one go is one run, so a layer's K is one piece (a
        4,096-token SmolLM2 replica: 60 pieces, not 15,360 of 12 KiB each)."""
        size = self.block_size
        first_block, end_block = start // size, -(-num_tokens // size)
        runs = []  # (first row, end row) of each run of consecutive block ids, as rows of the flat blocks
        for index in range(first_block, end_block):
            row = block_table[index] * size
            if runs and runs[-1][1] == row:
                runs[-1][1] = row + size
            else:
                runs.append([row, row + size])
        if runs:
            runs[0][0] += start - first_block * size  # the first block from `start` on
            runs[-1][1] -= end_block * size - num_tokens  # the last block up to the sequence's end
        layout = self.layout
        pieces = []
        for layer in range(layout.num_layers):
            for plane in range(2):
                rows = self.data[layer, plane].view(-1, layout.num_kv_heads, layout.head_dim)
                pieces.extend(rows[first:end] for first, end in runs)
        return pieces

    def import_sequence(self, kv: torch.Tensor, block_table: Sequence[int], start: int = 0) -> None:
        """Write a replica tensor from `export_sequence` into the blocks of `block_table`: its tokens are the
        sequence's positions start, start + 1, ... (a replica arriving in pieces is written piece by piece,
        never joined first)."""
        layout = self.layout
        expected = (layout.num_layers, 2, kv.shape[2], layout.num_kv_heads, layout.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV replica has shape {tuple(kv.shape)}, this cache expects {expected}")
        if kv.dtype != self.data.dtype:
            raise ValueError(f"KV replica has dtype {kv.dtype}, this cache holds {self.data.dtype}")
        positions = torch.arange(start, start + kv.shape[2], device=self.device)
        slots = slots_for(block_table, positions, self.block_size)
        self._flat().index_copy_(2, slots, kv.to(self.device))
