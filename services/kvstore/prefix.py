"""Content-addressed KV blocks: the keys that let requests share a prompt prefix's KV.

Every full block of `block_size` tokens gets a key chained from the previous block's key and its own token
ids, so a key names the whole prefix up to the end of its block, never a block alone (vLLM's automatic
prefix caching and LMCache key blocks the same way). The chain is seeded with the KV fingerprint (model,
layout, dtype, TP sharding), so KV of another model or layout can never match, and with the request's cache
salt, so tenants with different salts share no block. Every party (prefill, tests, tools) derives keys with
`prefix_block_keys` only.

`segment_range` is the ranged read of a run of tokens of one stored object. `reusable_blocks` says how
many leading blocks a prefill may take from the store: the last prompt token is always left to compute,
because the first output token's logits need a forward over it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pcpstack.kvstore.ranges import ByteRange, ByteRepeat

_DOMAIN = b"pcpstack.prefix-block.v1"
# Tokens per content-addressed block, whatever the engines' paged block size: a cached prefix then stops at
# most 15 tokens short of where a prompt diverges, so a conversation's next turn recomputes its new tokens
# and under 16 more (with the local stack's 128-token paged blocks as the unit, up to 127 more: turn 2 of
# bench e2e --multi-turn computed 150 tokens instead of 86). Every prefill of a store must use the same.
PREFIX_BLOCK_TOKENS = 16


def prefix_block_keys(
    token_ids: Sequence[int], block_size: int, fingerprint: str, salt: str = ""
) -> list[str]:
    """The keys (hex sha256) of every full block of token_ids, in order; a partial last block has none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    # Lengths before the variable fields, so no (fingerprint, salt) pair can be read as another.
    seed = hashlib.sha256(_DOMAIN)
    for part in (fingerprint.encode(), salt.encode()):
        seed.update(struct.pack("<I", len(part)) + part)
    previous = seed.digest()
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *token_ids[start : start + block_size])
        previous = hashlib.sha256(previous + block).digest()
        keys.append(previous.hex())
    return keys


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Most leading full blocks a prompt of num_tokens may take from the store: all that leave at least the
    last token to compute."""
    return max(num_tokens - 1, 0) // block_size


def segment_range(
    object_bytes: int, planes: int, row_bytes: int, token_start: int, token_count: int
) -> ByteRange:
    """The bytes of tokens [token_start, token_start + token_count) of an object laid out [planes, tokens,
    row] (KV: planes = layers * 2, row_bytes = one token's K or V of the object's heads), as one range."""
    plane = object_bytes // planes
    if plane * planes != object_bytes or plane % row_bytes:
        raise ValueError(
            f"an object of {object_bytes} bytes is not {planes} planes of whole {row_bytes}-byte rows"
        )
    if token_start < 0 or token_count <= 0 or (token_start + token_count) * row_bytes > plane:
        raise ValueError(
            f"tokens {token_start}..{token_start + token_count} are outside the object's {plane // row_bytes}"
        )
    return ByteRange(token_start * row_bytes, token_count * row_bytes, (ByteRepeat(plane, planes),))
