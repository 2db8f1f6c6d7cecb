"""DualChunkSwap: how one prompt's tokens are divided between the PCP ranks of a set.

The prompt is cut into 2P chunks of ceil(n / 2P) tokens (the last chunks may be short or empty); rank r
takes chunks r and 2P-1-r. Under a causal mask a token's attention work grows with its position, so pairing
an early chunk with a late one gives every rank about the same work.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class DualChunkSplit:
    """The split of an n-token prompt over pcp_size ranks."""

    num_tokens: int
    pcp_size: int

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or self.pcp_size < 1:
            raise ValueError(f"num_tokens={self.num_tokens} and pcp_size={self.pcp_size} must both be >= 1")

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk: ceil(n / 2P)."""
        return -(-self.num_tokens // (2 * self.pcp_size))

    def chunk(self, index: int) -> range:
        """Positions of chunk `index` (empty past the end of the prompt)."""
        start = min(index * self.chunk_size, self.num_tokens)
        return range(start, min(start + self.chunk_size, self.num_tokens))

    def positions(self, pcp_rank: int) -> list[int]:
        """Absolute positions rank pcp_rank computes: chunk r then chunk 2P-1-r."""
        if not 0 <= pcp_rank < self.pcp_size:
            raise ValueError(f"pcp_rank={pcp_rank} is outside 0..{self.pcp_size - 1}")
        return [*self.chunk(pcp_rank), *self.chunk(2 * self.pcp_size - 1 - pcp_rank)]

    @cached_property
    def max_local_tokens(self) -> int:
        """Largest local share; every rank pads to it so the all-gather moves equal-sized tensors."""
        return max(len(self.positions(r)) for r in range(self.pcp_size))

    @cached_property
    def gather_index(self) -> torch.Tensor:
        """[n] row of each position in the concatenation of all ranks' padded shares (rank-major).

        all-gathered rows indexed by this come out in position order, padding dropped.
        """
        index = torch.empty(self.num_tokens, dtype=torch.long)
        for rank in range(self.pcp_size):
            local = self.positions(rank)
            index[torch.tensor(local, dtype=torch.long)] = rank * self.max_local_tokens + torch.arange(
                len(local)
            )
        return index

    def last_position_owner(self) -> int:
        """The rank that computes the prompt's last position (and so samples the first token)."""
        last_chunk = (self.num_tokens - 1) // self.chunk_size
        return min(last_chunk, 2 * self.pcp_size - 1 - last_chunk)
