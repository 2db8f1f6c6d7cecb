"""A Llama-family decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Weights are fused where the math allows it (one qkv projection, one gate/up projection) to halve the kernel
launches per layer. The forward takes token ids with their absolute positions, writes K/V to the paged cache
at the slots in the attention metadata, and returns logits only for the rows asked for.

A tensor-parallel rank builds the same modules from its shard's arguments (its heads, its intermediate
slice; see services/engine/parallel.py) and passes its TP group: the attention output and MLP down
projections then give partial sums, which `tensor_parallel_sum` adds over the group. The single-rank model
has no group and runs exactly as before.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pcpstack.engine.attention import AttentionMetadata, paged_attention
from pcpstack.engine.config import ModelArgs
from pcpstack.engine.kv_cache import PagedKVCache
from pcpstack.engine.parallel import tensor_parallel_sum
from pcpstack.engine.quant import MAX_ROWS, BlockWeight, DecodeLayerKernel, DecodeModelKernel, project
from pcpstack.engine.rope import NO_SCALING, rotation


class Linear(nn.Linear):
    """nn.Linear that runs few-row inputs (decode) on the weight's quantized blocks when it has them. With
    `keep_blocks` the blocks are its only stored copy of the weight (`weight` is None): more rows take the
    blocks dequantized (quant.project), once and kept with `keep_dequantized`, else again on every call."""

    blocks: BlockWeight | None = None
    keep_dequantized: bool = False
    # With `keep_dequantized`: the fp32 weight dequantized from `blocks` for the first long input.
    dequantized: torch.Tensor | None = None

    def keep_blocks(self, blocks: BlockWeight, dense: bool, keep_dequantized: bool = False) -> None:
        """Use `blocks` for few rows; without `dense`, hold no dense weight (load no `weight` then), and with
        `keep_dequantized` keep the dense weight that long inputs dequantize from the blocks."""
        self.blocks, self.keep_dequantized = blocks, keep_dequantized
        if not dense:
            self.weight = None

    def dense_weight(self) -> torch.Tensor:
        """The weight as the dense matmul uses it: the loaded one, the cached one, or the blocks dequantized
        (kept with `keep_dequantized`, else a temporary)."""
        if self.weight is not None:
            return self.weight
        if self.dequantized is not None:
            return self.dequantized
        weight = self.blocks.dequantize()
        if self.keep_dequantized:
            self.dequantized = weight
        return weight

    def hold_dense(self) -> bool:
        """Dequantizes a weight held only in blocks now and keeps it as the dense weight: from then on more
        than MAX_ROWS rows take the dense matmul, as with a weight loaded dense (weights.load_model's
        `prefill`). False if there was nothing to do."""
        if self.weight is not None or self.blocks is None:
            return False
        weight = self.dequantized if self.dequantized is not None else self.blocks.dequantize()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.dequantized = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = project(x, self.weight, self.blocks, self.dense_weight)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Embedding):
    """nn.Embedding whose table may live only in quantized blocks (`weight` None): a lookup then dequantizes
    just the rows it reads."""

    blocks: BlockWeight | None = None

    def reset_parameters(self) -> None:
        """No random init: the model is built on the meta device and its weights are assigned right after.
        (nn.Embedding's normal_ on a meta tensor imported torch._dynamo: 1-7 s in every process that loads a
        model, every prefill rank and decode worker, for nothing.)"""

    def keep_blocks(self, blocks: BlockWeight) -> None:
        """Hold the table only as `blocks` (load no `weight` then)."""
        self.blocks, self.weight = blocks, None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.blocks.dequantize(token_ids)
        return F.embedding(token_ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the run dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, head_dim] by the angles of its positions; pairs are (i, i + head_dim / 2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache (a TP rank: its own heads)."""

    def __init__(self, args: ModelArgs, layer_index: int, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.tp_group = tp_group
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = Linear(args.dim, qkv_dim, bias=args.attention_bias)
        self.wo = Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split((q_dim, kv_dim, kv_dim), dim=-1)
        q = apply_rope(q.view(n, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.n_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.n_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache.layer(self.layer_index)
        return tensor_parallel_sum(self.wo(paged_attention(q, k, v, k_cache, v_cache, meta)), self.tp_group)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(gate(x)) * up(x)), gate and up fused into one matmul (a TP rank: its slice)."""

    def __init__(self, args: ModelArgs, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.w13 = Linear(args.dim, 2 * args.hidden_dim, bias=False)
        self.w2 = Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return tensor_parallel_sum(self.w2(F.silu(gate) * up), self.tp_group)


class Block(nn.Module):
    """One pre-norm decoder layer. With its projections in blocks, a decode step (a few fp32 rows on the CPU,
    one new token per sequence) runs as one fused C call instead (`fuse_decode`)."""

    def __init__(self, args: ModelArgs, layer_index: int, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_index, tp_group)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args, tp_group)
        self.decode_kernel: DecodeLayerKernel | None = None

    def fuse_decode(self) -> bool:
        """Run decode steps through the fused C layer, where it applies: every projection in blocks, no TP
        group. Returns whether it does."""
        attention, ffn = self.attention, self.feed_forward
        projections = {"qkv": attention.wqkv, "wo": attention.wo, "w13": ffn.w13, "w2": ffn.w2}
        blocks = {name: linear.blocks for name, linear in projections.items() if linear.blocks is not None}
        if attention.tp_group is not None or len(blocks) < len(projections):
            return False
        self.decode_kernel = DecodeLayerKernel.build(
            blocks,
            attention.wqkv.bias,
            (self.attention_norm.weight, self.ffn_norm.weight),
            self.attention_norm.eps,
            attention.n_heads,
            attention.n_kv_heads,
            attention.head_dim,
        )
        return True

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.decode_kernel is not None and _plain_decode(x, meta):
            caches = kv_cache.layer(self.attention.layer_index)
            tables = (meta.slot_mapping, meta.block_tables, meta.context_lens)
            return self.decode_kernel(x, cos, sin, caches, *tables)
        h = x + self.attention(self.attention_norm(x), cos, sin, kv_cache, meta)
        return h + self.feed_forward(self.ffn_norm(h))


def _plain_decode(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this step is what the fused decode layer computes: a few fp32 rows on the CPU, one new token
    per sequence attending to its own paged cache (no context-parallel exchange, no DCP split, not a batched
    prefill, whose groups may be empty)."""
    return (
        x.shape[0] == meta.num_seqs
        and meta.query_lens is None
        and x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not meta.fresh_context
        and meta.kv_exchange is None
        and meta.dcp is None
    )


class Transformer(nn.Module):
    """The decoder: embeddings, layers, final norm and the (possibly tied) output projection.

    `args` are the arguments this process runs (a TP rank's shard arguments); `tp_group` is the TP group
    whose ranks hold the other heads and slices (None: the whole model). Embedding and LM head are
    replicated on every TP rank.
    """

    def __init__(self, args: ModelArgs, tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i, tp_group) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # The logits projection's quantized blocks (the embedding's when tied), for decode.
        self.output_blocks: BlockWeight | None = None
        # Every layer, the final norm and the logits of a decode step as one C call (`fuse_decode`).
        self.decode_kernel: DecodeModelKernel | None = None
        # RoPE frequencies (scaled as the checkpoint declares) computed once, not per step; dynamic scaling
        # derives each step's from them and the sequences' lengths (`rope_frequencies`).
        self.rope_scaling = args.rope_scaling or NO_SCALING
        self.rope_inv_freq = self.rope_scaling.inv_frequencies(args.head_dim, args.rope_theta)
        self.rope_scale = self.rope_scaling.cos_sin_scale

    def fuse_decode(self) -> bool:
        """Run a decode step's layers, final norm and logits projection as one C call, where every layer
        runs fused (Block.fuse_decode) and the logits projection is in blocks. Returns whether it does."""
        layers = [layer.decode_kernel for layer in self.layers]
        if self.output_blocks is None or any(kernel is None for kernel in layers):
            return False
        norm = self.norm
        self.decode_kernel = DecodeModelKernel.build(layers, norm.weight, norm.eps, self.output_blocks)
        return True

    def output_weight(self) -> torch.Tensor | None:
        """[vocab, dim] dense weight of the logits projection (the embedding when tied); None when it is kept
        only in blocks (`output_blocks`)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def rope_frequencies(self, meta: AttentionMetadata) -> torch.Tensor:
        """The step's RoPE frequencies: [head_dim / 2] for every query, or with dynamic scaling
        [n, head_dim / 2], each query its sequence's for the length `meta` gives it (rope_lens)."""
        if not self.rope_scaling.rotates_by_length:
            return self.rope_inv_freq
        lengths = meta.rope_lens if meta.rope_lens is not None else meta.context_lens
        per_seq = self.rope_scaling.frequencies_by_length(
            lengths, self.rope_inv_freq, self.args.head_dim, self.args.rope_theta
        )  # [B, head_dim / 2]
        if meta.query_lens is None and meta.positions.numel() == meta.num_seqs:  # decode: a query each
            return per_seq
        counts = torch.tensor(meta.query_counts(), device=per_seq.device)
        return per_seq.repeat_interleave(counts, dim=0)  # [n, head_dim / 2]

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] (all n rows when None) for token_ids [n] at positions [n]."""
        # Weights kept in blocks or in 16-bit give rows in another dtype than the run's (the norms').
        x = self.tok_embeddings(token_ids).to(self.norm.weight.dtype)  # [n, dim]
        cos, sin = rotation(positions, self.rope_frequencies(meta), self.rope_scale, x.dtype)
        if logits_indices is None and self.decode_kernel is not None and _plain_decode(x, meta):
            tables = (meta.slot_mapping, meta.block_tables, meta.context_lens)
            return self.decode_kernel(x, cos, sin, kv_cache.data, *tables)  # [n, vocab]
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        if logits_indices is not None:
            x = x[logits_indices]  # [len(logits_indices), dim]
        return project(self.norm(x), self.output_weight(), self.output_blocks)  # [rows, vocab]
