"""Attention over the paged KV cache, and the one seam where context-parallel prefill exchanges K/V.

A forward step carries `AttentionMetadata`: the query positions, the cache slots to write, and for reading the
block tables and context lengths of the B sequences in the step. The queries are B equal groups of tokens, one
group per sequence: B = 1 with any number of tokens for (chunked) prefill, or one token per sequence for
batched decode; batched prefill gives unequal groups (`query_lens`). The causal mask always comes from true
positions (query at position p sees keys at <= p), so queries need not be contiguous; that is what
context-parallel prefill relies on.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pcpstack.engine import cpu_kernels, dense
from pcpstack.engine.dcp import DcpStep, dcp_decode_attention

KvExchange = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionMetadata:
    """What one forward step needs to write and read the paged KV cache.

    positions: [n] absolute positions of the query tokens, grouped by sequence.
    slot_mapping: [m] cache slots receiving this step's K/V rows, in the order attention holds them (m == n,
        or the whole prompt when `kv_exchange` gathers K/V from all context-parallel ranks).
    block_tables: [B, max_blocks] block ids of each sequence (padded with any valid id).
    context_lens: [B] keys each sequence has once this step's K/V are written.
    kv_exchange: called by every layer as `k, v = kv_exchange(k, v)` on the local K/V ([n, kv_heads,
        head_dim], RoPE applied); returns the K/V that `slot_mapping` addresses.
    fresh_context: True when the K/V rows after the exchange are a single sequence's whole context in
        position order (one-shot prefill): attention then uses them directly instead of reading the cache,
        and when the queries are those same rows, the causal kernel.
    dcp: set on a decode context-parallel rank's decode step (engine.dcp): the cache holds only the rank's
        token blocks, `block_tables` and `context_lens` are local, `slot_mapping` addresses only the rows
        `dcp.write_rows` this rank owns.
    query_lens: set by batched prefill (prefill.batch), whose B sequences bring unequal numbers of queries:
        the queries are grouped by sequence in this order (a group may be empty), and each attends to its own
        sequence's context in the cache, causally by position.
    rope_lens: [B] the length by which dynamic RoPE picks each sequence's frequencies this step (the
        length of the whole forward transformers would run: the whole prompt for every chunk of a prefill);
        None: context_lens, which is that length for a one-shot prefill and a plain decode step.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int
    kv_exchange: KvExchange | None = None
    fresh_context: bool = False
    dcp: DcpStep | None = None
    query_lens: list[int] | None = None
    rope_lens: torch.Tensor | None = None
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _runs: list[tuple[int, int]] | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        """Sequences in this step (B)."""
        return self.block_tables.shape[0]

    def query_counts(self) -> list[int]:
        """How many of the step's queries each sequence brings, in order."""
        if self.query_lens is not None:
            return self.query_lens
        return [self.positions.numel() // self.num_seqs] * self.num_seqs

    def query_runs(self) -> list[tuple[int, int]]:
        """The queries' positions as maximal runs [start, end) of consecutive positions (one sequence).

        A context-parallel rank's DualChunkSwap share is two runs.
        """
        if self._runs is None:
            self._runs = position_runs(self.positions.tolist())
        return self._runs

    def key_mask(self, q_per_kv: int) -> torch.Tensor:
        """[B, 1, q_per_kv * tokens_per_seq, max_context_len] bool: which keys each grouped query may see."""
        if self._mask is None:
            batch = self.num_seqs
            key_pos = torch.arange(self.max_context_len, device=self.positions.device)
            query_pos = self.positions.view(batch, -1, 1)
            visible = (key_pos <= query_pos) & (key_pos < self.context_lens.view(batch, 1, 1))
            # Query heads sharing a K/V head are stacked along the query axis: (group, token) order.
            tokens = query_pos.shape[1]
            self._mask = (
                visible[:, None, None].expand(batch, 1, q_per_kv, tokens, self.max_context_len)
            ).reshape(batch, 1, q_per_kv * tokens, self.max_context_len)
        return self._mask


def position_runs(positions: list[int]) -> list[tuple[int, int]]:
    """Positions as maximal runs [start, end) of consecutive values, in order."""
    breaks = [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
    starts = [0, *breaks]
    ends = [*breaks, len(positions)]
    return [(positions[s], positions[e - 1] + 1) for s, e in zip(starts, ends, strict=True) if e > s]


def exchange_kv(
    k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """The context-parallel seam: the step's K/V as the cache and attention must see them.

    Without an exchange these are the local K/V. Context-parallel prefill sets `meta.kv_exchange` to an
    all-gather across the PCP ranks that returns the whole prompt's K/V in position order.
    """
    if meta.kv_exchange is None:
        return k, v
    return meta.kv_exchange(k, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the cache and attend the queries to each sequence's context.

    q: [n, n_heads, head_dim]; k, v: [n, n_kv_heads, head_dim] with RoPE applied; caches
    [num_blocks, block_size, n_kv_heads, head_dim]. Returns [n, n_heads * head_dim].
    """
    if meta.dcp is not None:
        return dcp_decode_attention(q, k, v, k_cache, v_cache, meta, meta.dcp)
    k, v = exchange_kv(k, v, meta)
    n_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, n_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    if meta.query_lens is not None:
        return attend_sequences(q, k_cache, v_cache, meta)

    batch = meta.num_seqs
    n, n_heads, _ = q.shape
    q_per_kv = n_heads // n_kv_heads
    tokens = n // batch
    if meta.fresh_context and k.shape[0] == n:
        # Queries are the keys, in position order: the causal kernel skips the masked half of the work.
        if _products_on_onednn(q, n):
            return attend_runs(q, k, v, [(0, n)], q_per_kv)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )  # [1, H, n, D]
        return out[0].transpose(0, 1).reshape(n, n_heads * head_dim)
    if meta.fresh_context and q.device.type == "cpu" and n > 0:
        return attend_runs(q, k, v, meta.query_runs(), q_per_kv)
    if not meta.fresh_context and batch == 1 and tokens > 1 and q.device.type == "cpu":
        # Prefill after a held prefix (a chunk, a cached prefix): the context's K/V read back from the cache
        # in position order, then the run-wise kernel of a fresh prompt (no mask, causal half skipped).
        blocks = meta.block_tables[0]
        keys = k_cache.index_select(0, blocks).flatten(0, 1)[: meta.max_context_len]
        values = v_cache.index_select(0, blocks).flatten(0, 1)[: meta.max_context_len]
        return attend_runs(q, keys, values, meta.query_runs(), q_per_kv)
    decode = not meta.fresh_context and tokens == 1 and meta.kv_exchange is None
    if decode and q.device.type == "cpu" and q.dtype == torch.float32:
        # Decode: one query per sequence read straight from its blocks, no gather of the whole context. (A
        # context-parallel rank's single query may sit before other ranks' new keys: it takes the mask.)
        lib = cpu_kernels.library()
        if lib is not None:
            out = cpu_kernels.paged_decode_attention(
                lib, q, k_cache, v_cache, meta.block_tables, meta.context_lens
            )
            return out.view(n, n_heads * head_dim)
    if meta.fresh_context:
        keys, values = k[None], v[None]  # [1, ctx, kv_heads, head_dim]
    else:
        # [B, max_blocks * block_size, kv_heads, head_dim], trimmed to the longest context in the step.
        blocks = meta.block_tables.flatten()
        shape = (batch, -1, n_kv_heads, head_dim)
        keys = k_cache.index_select(0, blocks).view(shape)[:, : meta.max_context_len]
        values = v_cache.index_select(0, blocks).view(shape)[:, : meta.max_context_len]
    # [n, H, D] -> [B, kv_heads, q_per_kv * tokens, D]: queries of one K/V head side by side, no K/V copies.
    q = q.view(batch, tokens, n_kv_heads, q_per_kv, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, n_kv_heads, q_per_kv * tokens, head_dim)
    out = F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=meta.key_mask(q_per_kv)
    )
    # [B, kv_heads, q_per_kv * tokens, D] -> [n, H * D]
    out = out.view(batch, n_kv_heads, q_per_kv, tokens, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(n, n_heads * head_dim)


def attend_sequences(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Queries of several sequences in unequal groups (`meta.query_lens`), each group attending causally to
    its own sequence's context read back from the cache: a block-diagonal mask without building it.

    q: [n, H, D]; caches [num_blocks, block_size, kv_heads, D], already holding this step's K/V. On CPU each
    group takes the run-wise kernel of a single prompt (the same arithmetic as prefilling it alone);
    elsewhere a masked kernel on its true positions. Returns [n, H * D].
    """
    assert meta.query_lens is not None
    n, n_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    q_per_kv = n_heads // k_cache.shape[2]
    outputs, offset = [], 0
    for seq, count in enumerate(meta.query_lens):
        if count == 0:  # this rank holds none of the sequence's new tokens
            continue
        group, positions = q[offset : offset + count], meta.positions[offset : offset + count]
        offset += count
        context = int(meta.context_lens[seq])
        blocks = meta.block_tables[seq, : -(-context // block_size)]
        keys = k_cache.index_select(0, blocks).flatten(0, 1)[:context]  # [context, kv_heads, D]
        values = v_cache.index_select(0, blocks).flatten(0, 1)[:context]
        if q.device.type == "cpu":
            outputs.append(attend_runs(group, keys, values, position_runs(positions.tolist()), q_per_kv))
            continue
        visible = torch.arange(context, device=q.device)[None] <= positions[:, None]  # [count, context]
        out = F.scaled_dot_product_attention(
            group.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=visible,
            enable_gqa=True,
        )  # [1, H, count, D]
        outputs.append(out[0].transpose(0, 1).reshape(count, n_heads * head_dim))
    return torch.cat(outputs) if outputs else q.new_empty(n, n_heads * head_dim)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

# Query rows per causal diagonal block in `attend_runs`. The CPU flash kernel computes the last key block of a
# causal call in full (up to 512 keys wide), so one long causal run costs well over its share: a PCP=2 rank's
# run of 1,024-2,048 queries took 1.15-1.30x half of the whole prompt's causal call (SmolLM2's shapes, one
# thread). Blocks of 256 bound that waste (1.10-1.15x), and the keys before a block are plain, unmasked
# work; 192 and 512 measured slower. The one-shot prompt keeps the whole causal call: blocks were no faster.
DIAGONAL_BLOCK = 256

# Where the engine's dense products run on oneDNN (engine.dense: torch's CPU matmuls, MKL's, are half as fast
# there, and torch's CPU flash kernel uses them), attention's two products go to oneDNN too, a block of
# queries at a time: the 2,048-token causal prompt of a SmolLM2 layer took 47-57 ms against the flash kernel's
# 75-78 (AMD EPYC, one thread; blocks of 64, 96 and 192 queries measured 3-10 % slower than 128). Below
# ONEDNN_MIN_KEYS keys the flash kernel stays: its work is small there, and oneDNN's first call of each new
# shape costs 1-5 ms. The bound is chosen, not a measured crossover (43 queries over 1,430 keys took about
# the same on either: 2.1 against 2.4 ms a layer).
ONEDNN_BLOCK = 128
ONEDNN_MIN_KEYS = 512


def _products_on_onednn(q: torch.Tensor, keys: int) -> bool:
    """Whether attention of q over `keys` keys takes oneDNN's products (fp32 on the CPU, long enough)."""
    fp32_cpu = q.dtype == torch.float32 and q.device.type == "cpu"
    return keys >= ONEDNN_MIN_KEYS and fp32_cpu and dense.use_onednn()


def attend_runs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    runs: list[tuple[int, int]],
    q_per_kv: int,
    block: int | None = None,
) -> torch.Tensor:
    """Causal attention of queries made of runs of consecutive positions to a whole prompt's K/V (CPU).

    q: [n, H, D], the queries of `runs` in order; k, v: [ctx, kv_heads, D] in position order. Each run is
    cut into blocks of at most `block` queries; a block [s, e) sees every key before s (a plain block, no
    mask) and the diagonal block [s, e) causally; the two partial results are merged with their log-sum-exp
    weights. Unlike a masked kernel this skips the masked-out work, which is what gives context-parallel
    ranks their share of the causal saving. Where the dense products run on oneDNN (engine.dense) and the
    context is long enough, each block is instead one product against every key up to its end
    (`_attend_block_onednn`), in blocks of `ONEDNN_BLOCK` (unless `block` is given) that end at its
    multiples. Returns [n, H * D].
    """
    on_onednn = _products_on_onednn(q, k.shape[0])
    if on_onednn:
        # K as [kv_heads, ctx, D] and V as [kv_heads, D, ctx]: each block's products take leading slices.
        k, v = k.transpose(0, 1).contiguous(), v.permute(1, 2, 0).contiguous()
    block = block or (ONEDNN_BLOCK if on_onednn else DIAGONAL_BLOCK)
    attend = _attend_block_onednn if on_onednn else _attend_block
    outputs, offset = [], 0
    for run_start, run_end in runs:
        start = run_start
        while start < run_end:
            # oneDNN's blocks end at multiples of `block` (or the run's end): their shapes recur from prompt
            # to prompt, where a context-parallel rank's runs, which start where the split puts them, would
            # otherwise bring oneDNN new shapes to build code for (1-5 ms each) in every block of every new
            # prompt length.
            end = min((start // block + 1) * block if on_onednn else start + block, run_end)
            length = end - start
            outputs.append(attend(q[offset : offset + length], k, v, start, end, q_per_kv))
            offset += length
            start = end
    return torch.cat(outputs)


def _attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int, q_per_kv: int
) -> torch.Tensor:
    """Queries q [L, H, D] at positions [start, end) attending causally to k, v [ctx, kv_heads, D] (position
    order): the diagonal block causally, the keys before it plainly, merged. Returns [L, H * D]."""
    length, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    # Diagonal block: per-head copies of this block's K/V only (small), so the causal kernel applies.
    diag_k = k[start:end].repeat_interleave(q_per_kv, dim=1).transpose(0, 1)[None]
    diag_v = v[start:end].repeat_interleave(q_per_kv, dim=1).transpose(0, 1)[None]
    out, lse = _flash_cpu(q.transpose(0, 1)[None], diag_k, diag_v, 0.0, True)  # [1, H, L, D], [1, H, L]
    if start > 0:
        # Prefix block: queries sharing a K/V head side by side, no K/V copies.
        grouped = q.view(1, length, n_kv_heads, q_per_kv, head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(1, n_kv_heads, q_per_kv * length, head_dim)
        prefix_k, prefix_v = k[:start].transpose(0, 1)[None], v[:start].transpose(0, 1)[None]
        prefix_out, prefix_lse = _flash_cpu(grouped, prefix_k, prefix_v, 0.0, False)
        prefix_out = prefix_out.reshape(1, n_heads, length, head_dim)
        prefix_lse = prefix_lse.reshape(1, n_heads, length)
        # The diagonal part's weight exp(lse) / (exp(lse) + exp(prefix_lse)), blended in one pass (lerp).
        out = torch.lerp(prefix_out, out, torch.sigmoid(lse - prefix_lse)[..., None])
    return out[0].transpose(0, 1).reshape(length, n_heads * head_dim)


def _attend_block_onednn(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, end: int, q_per_kv: int
) -> torch.Tensor:
    """Queries q [L, H, D] at positions [start, end) attending causally to keys [kv_heads, ctx, D] and
    values [kv_heads, D, ctx] (both contiguous, position order) with oneDNN's products: per K/V head the
    block's queries of its heads stacked as one [q_per_kv * L, D] operand, scores against every key before
    `end`, the diagonal square's upper triangle masked, one softmax a row. Returns [L, H * D]."""
    length, n_heads, head_dim = q.shape
    n_kv_heads = keys.shape[0]
    grouped = (q * head_dim**-0.5).view(length, n_kv_heads, q_per_kv, head_dim).permute(1, 2, 0, 3)
    # -inf above the diagonal square's diagonal, added (a masked_fill of the strided slice was 7x as slow).
    future = torch.full((length, length), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    out = q.new_empty(length, n_kv_heads, q_per_kv, head_dim)
    for head in range(n_kv_heads):
        rows = grouped[head].reshape(q_per_kv * length, head_dim)
        scores = dense.onednn_linear(rows, keys[head, :end]).view(q_per_kv, length, end)
        scores[:, :, start:].add_(future)
        probs = torch.softmax(scores, dim=-1).view(q_per_kv * length, end)
        mixed = dense.onednn_linear(probs, values[head, :, :end].contiguous())  # [q_per_kv * L, D]
        out[:, head] = mixed.view(q_per_kv, length, head_dim).transpose(0, 1)
    return out.view(length, n_heads * head_dim)
