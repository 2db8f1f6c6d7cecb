"""Weights kept in a GGUF file's own quantized blocks, for every matmul that uses them.

Dequantized to fp32, SmolLM2's weights are 540 MB; in their Q4_1/Q8_0 blocks they are about 100 MB, and a
decode step is bound by the bytes of weights it reads. With weights kept stored (weights.py) a `BlockWeight`
is the only copy of a projection the engine loads: `BlockWeight.matmul` computes x @ W^T for a few rows
(decode, short prompts) straight from the blocks with the C kernels of cpu_kernels.c; for more rows
`project` runs the BLAS matmul on the projection dequantized to fp32 (by default kept from the first such
input on, model.Linear; with weights "stored" a temporary each call), and an embedding lookup dequantizes
only the rows it looks up.

Three forms hold every type the kernels run, 32 weights a block, scales and mins in fp32: "q4_1" (w = scale
* q + min, 4-bit q), "q8_0" (w = scale * q, int8 q) and "q6_k" (w = scale * q, q in [-32, 31] held as int8,
a scale for each 16 weights). GGUF's Q4_1, Q8_0 and Q6_K map onto them directly, Q4_0 and Q4_K (whose
32-wide sub-blocks have their own scale and min) exactly: `dequantize` gives the values of
`gguf.quants.dequantize` (fp16 scales times small integers are exact in fp32, so every product and sum
rounds as gguf's does; only Q4_0's zeros may differ in sign: +0 where gguf's d * (q - 8) gives -0). Q6_K's
scale is gguf's d * sc (an fp16 times an int8, exact), its q unpacked from 6 bits to a byte: 1.25 bytes a
weight against the file's 0.82 and fp32's 4, for a kernel as simple as Q8_0's. (q kept in 6 bits, 1.0 byte a
weight with the scales, took 1.3x the time at 1 row and 1.2x at 16 here, one thread: unpacking the bits costs
more than the bytes it saves.)

A fused projection whose parts differ in type (a Q4_K_M file's Q4_K query and key beside its Q6_K value) is a
chain: a `BlockWeight` whose `next` holds the rows that follow, in their own form.
"""

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pcpstack.engine import cpu_kernels, dense

BLOCK = 32
# The GGUF types `from_gguf` holds in blocks.
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0")
# Weights per scale, by form: Q6_K scales every 16.
SCALE_GROUP = {"q4_1": BLOCK, "q8_0": BLOCK, "q6_k": 16}
# Up to this many rows (decode batches, short prefill chunks) the block kernels beat the dense matmul here.
MAX_ROWS = 16
# Up to this many rows, a projection held only in blocks runs on the block kernels too: below that,
# dequantizing it for the BLAS matmul costs more (SmolLM2's four projections of a layer, one thread, CPU time:
# 13 against 18 ms at 128 rows, 24 against 22 at 192; bench/engine_weights.py measures whole prompts). That
# was with weights "stored"; "cached" keeps the limit, so that its logits equal stored's bit for bit.
MAX_ROWS_WITHOUT_DENSE = 128


def _kernels() -> ctypes.CDLL:
    """The built C kernels. Blocks and fused kernels exist only where the engine chose the kernels
    (weights.py asks cpu_kernels.library()), so their absence here is a bug, not a configuration."""
    lib = cpu_kernels.build_library()
    if lib is None:
        raise RuntimeError("the CPU block kernels are not available")
    return lib


@dataclass(frozen=True)
class BlockWeight:
    """A [rows, cols] weight in 32-wide blocks along cols: Q4_1 (w = scale * q + min), Q8_0 or Q6_K
    (w = scale * q).

    qs: [rows, cols / 32, 16] uint8 nibbles (Q4_1) or [rows, cols / 32, 32] int8 (Q8_0, Q6_K); scale: fp32
    [rows, cols / 32], [rows, cols / 16] for Q6_K; minimum: [rows, cols / 32] fp32, None but for Q4_1.
    `next`: the rows that follow these in another form (a fused projection of mixed types), or None.
    """

    kind: str
    qs: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    next: "BlockWeight | None" = None

    def parts(self) -> "list[BlockWeight]":
        """The chain's parts in row order, each without its `next`."""
        part: BlockWeight | None = self
        parts = []
        while part is not None:
            parts.append(BlockWeight(part.kind, part.qs, part.scale, part.minimum))
            part = part.next
        return parts

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the weight it encodes, the whole chain's rows."""
        rest = 0 if self.next is None else self.next.shape[0]
        return self.qs.shape[0] + rest, self.qs.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes of memory its parts take."""
        parts = (self.qs, self.scale, self.minimum)
        rest = 0 if self.next is None else self.next.nbytes
        return rest + sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight in fp32 [rows, cols], or only the rows at the indices `rows` (an embedding lookup): the
        values gguf.quants.dequantize gives for the stored blocks."""
        if self.next is not None:
            whole = torch.cat([part.dequantize() for part in self.parts()])
            return whole if rows is None else whole[rows]
        qs, scale, minimum = self.qs, self.scale, self.minimum
        if rows is not None:
            qs, scale = qs[rows], scale[rows]
            minimum = None if minimum is None else minimum[rows]
        weight = torch.empty(*qs.shape[:-1], BLOCK, dtype=torch.float32)
        if self.kind == "q4_1":
            # A block's 16 bytes hold its weights 0-15 in their low nibbles and 16-31 in their high ones.
            weight[..., :16] = qs & 0x0F
            weight[..., 16:] = qs >> 4
        else:
            weight.copy_(qs)
        # In place, one scale group a row: three times faster here than one broadcast addcmul. Multiply,
        # then add, as gguf's (d * q) + m rounds (the product is exact anyway: fp16 scale, small integer).
        groups = weight.view(-1, SCALE_GROUP[self.kind]).mul_(scale.reshape(-1, 1))
        if minimum is not None:
            groups.add_(minimum.reshape(-1, 1))
        return weight.view(*weight.shape[:-2], self.shape[1])

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "BlockWeight":
        """The weight with `fn` applied to the rows of every part (a row permutation, a slice); not for a
        chain (rows are permuted before parts are fused)."""
        if self.next is not None:
            raise ValueError("map_rows of a chain of block forms")
        minimum = None if self.minimum is None else fn(self.minimum).contiguous()
        return BlockWeight(self.kind, fn(self.qs).contiguous(), fn(self.scale).contiguous(), minimum)

    def columns(self, columns: slice) -> "BlockWeight":
        """The weight's columns `columns` (on block edges: a TP rank's input slice)."""
        if columns.start % BLOCK or columns.stop % BLOCK:
            raise ValueError(f"columns {columns.start}:{columns.stop} cut {BLOCK}-wide blocks")
        cut = slice(columns.start // BLOCK, columns.stop // BLOCK)
        group = SCALE_GROUP[self.kind]
        scale = self.scale[:, columns.start // group : columns.stop // group].contiguous()
        minimum = None if self.minimum is None else self.minimum[:, cut].contiguous()
        rest = None if self.next is None else self.next.columns(columns)
        return BlockWeight(self.kind, self.qs[:, cut].contiguous(), scale, minimum, rest)

    @staticmethod
    def cat(parts: "list[BlockWeight]") -> "BlockWeight | None":
        """The parts stacked along rows (a fused projection): neighbours of one form joined, a chain where
        forms change; None when their widths differ."""
        pieces = [piece for part in parts for piece in part.parts()]
        if len({piece.shape[1] for piece in pieces}) != 1:
            return None
        runs: list[list[BlockWeight]] = []
        for piece in pieces:
            if runs and runs[-1][0].kind == piece.kind:
                runs[-1].append(piece)
            else:
                runs.append([piece])
        joined: BlockWeight | None = None
        for run in reversed(runs):
            minimum = None if run[0].minimum is None else torch.cat([p.minimum for p in run])
            qs, scale = torch.cat([p.qs for p in run]), torch.cat([p.scale for p in run])
            joined = BlockWeight(run[0].kind, qs, scale, minimum, joined)
        return joined

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, cols] fp32 @ W^T -> [m, rows] fp32, on the block kernels."""
        if x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"block matmul: x has shape {tuple(x.shape)}, expected [m, {self.shape[1]}]")
        lib = _kernels()
        if self.next is None:
            return cpu_kernels.block_matmul(lib, self.kind, x, self.qs, self.scale, self.minimum)
        outs = [cpu_kernels.block_matmul(lib, p.kind, x, p.qs, p.scale, p.minimum) for p in self.parts()]
        return torch.cat(outs, dim=1)


@dataclass(frozen=True)
class DecodeLayerKernel:
    """A decoder layer's decode step as one call of cpu_kernels.c's `decode_layer`: norms, projections on
    their blocks, RoPE, the K/V cache write, paged attention, SwiGLU and both residuals in one parallel region
    (what model.Block computes, up to summation order). At batch 1 the fifty-odd PyTorch operations and five
    kernel calls of a layer cost more than its weights take to read."""

    weights: cpu_kernels.DecodeLayerWeightsC
    # The tensors `weights` points into, kept alive with it.
    tensors: tuple[torch.Tensor, ...]

    @staticmethod
    def build(
        projections: "dict[str, BlockWeight]",
        qkv_bias: torch.Tensor | None,
        norms: tuple[torch.Tensor, torch.Tensor],
        eps: float,
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> "DecodeLayerKernel":
        """From the layer's projections in blocks (keys qkv, wo, w13, w2), its qkv bias, its attention and FFN
        norm weights (fp32) and its head layout."""
        tensors: list[torch.Tensor] = [*norms, *([] if qkv_bias is None else [qkv_bias])]

        def part(name: str, bias: torch.Tensor | None = None) -> cpu_kernels.BlockWeightC:
            return _block_weight_struct(projections[name], bias, tensors)

        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            raise ValueError("the fused decode layer needs contiguous fp32 norm weights and bias")
        hidden = projections["w2"].shape[1]
        weights = cpu_kernels.DecodeLayerWeightsC(
            part("qkv", qkv_bias),
            part("wo"),
            part("w13"),
            part("w2"),
            norms[0].data_ptr(),
            norms[1].data_ptr(),
            eps,
            projections["wo"].shape[0],
            heads,
            kv_heads,
            head_dim,
            hidden,
        )
        return DecodeLayerKernel(weights, tuple(tensors))

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """The layer's output [m, dim] for x [m, dim], one new token per sequence (see decode_layer)."""
        lib = _kernels()
        tables = (slots, block_tables, context_lens)
        return cpu_kernels.decode_layer(lib, self.weights, x, cos, sin, *caches, *tables)


@dataclass(frozen=True)
class DecodeModelKernel:
    """A whole model's decode step after the embedding as one call of cpu_kernels.c's `decode_model`: every
    layer's DecodeLayerKernel in turn, the final norm and the logits projection, in one parallel region (per
    step one C call instead of one per layer and one more for the logits)."""

    weights: cpu_kernels.DecodeModelWeightsC
    vocab: int
    # What `weights` points into (the layer kernels, the pointer array, tensors), kept alive with it.
    keep: tuple[object, ...]

    @staticmethod
    def build(
        layers: "list[DecodeLayerKernel]", norm: torch.Tensor, eps: float, head: BlockWeight
    ) -> "DecodeModelKernel":
        """From the layers' kernels in order, the final norm's weight (fp32) and the logits projection."""
        if norm.dtype != torch.float32 or not norm.is_contiguous():
            raise ValueError("the fused decode step needs a contiguous fp32 final norm weight")
        # decode_model sizes its scratch by the first layer.
        shapes = {
            tuple(getattr(k.weights, f) for f in ("dim", "heads", "kv_heads", "head_dim", "hidden"))
            for k in layers
        }
        if len(shapes) != 1:
            raise ValueError(
                "the fused decode step needs at least one layer, all of one shape; got (dim, heads, "
                f"kv_heads, head_dim, hidden) {sorted(shapes)}"
            )
        tensors: list[torch.Tensor] = [norm]
        head_struct = _block_weight_struct(head, None, tensors)
        pointers = (ctypes.POINTER(cpu_kernels.DecodeLayerWeightsC) * len(layers))(
            *(ctypes.pointer(layer.weights) for layer in layers)
        )
        weights = cpu_kernels.DecodeModelWeightsC(pointers, len(layers), norm.data_ptr(), eps, head_struct)
        keep = (tuple(layers), pointers, head_struct, tuple(tensors))
        return DecodeModelKernel(weights, head.shape[0], keep)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [m, vocab] for x [m, dim], one new token per sequence (see decode_model)."""
        lib = _kernels()
        tables = (slots, block_tables, context_lens)
        return cpu_kernels.decode_model(lib, self.weights, self.vocab, x, cos, sin, kv_cache, *tables)


def _block_weight_struct(
    blocks: BlockWeight, bias: torch.Tensor | None, tensors: list[torch.Tensor]
) -> cpu_kernels.BlockWeightC:
    """cpu_kernels.c's block_weight for `blocks` (a chain of structures for a chain of forms) and its bias;
    the tensors it points into are appended to `tensors`, for the caller to keep alive."""
    structs = []
    row = 0
    for w in blocks.parts():
        tensors.extend(t for t in (w.qs, w.scale, w.minimum) if t is not None)
        # Each part's bias starts at its own first row.
        part_bias = None if bias is None else bias[row:]
        pointers = (w.qs, w.scale, w.minimum, part_bias)
        structs.append(
            cpu_kernels.BlockWeightC(
                cpu_kernels.KIND_CODES[w.kind],
                *w.shape,
                *(None if t is None else t.data_ptr() for t in pointers),
            )
        )
        row += w.shape[0]
    # Back to front, so each part links to a finished successor (ctypes keeps it alive with it).
    for struct, successor in zip(structs[-2::-1], structs[:0:-1], strict=True):
        struct.next = ctypes.pointer(successor)
    return structs[0]


def _fp16_field(raw: np.ndarray, offset: int) -> torch.Tensor:
    return torch.from_numpy(raw[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def from_gguf(data: np.ndarray, type_name: str) -> BlockWeight | None:
    """The blocks of a GGUF tensor's raw bytes ([rows, bytes per row] uint8); None for a type no form holds
    (plain types, Q5_K, ...).

    Q4_1 block: fp16 scale, fp16 min, 16 bytes of nibbles. Q8_0: fp16 scale, 32 int8. Q4_0: fp16 scale and
    16 bytes of nibbles q, w = scale * (q - 8). Q4_K: 256 weights in 8 sub-blocks of 32, fp16 d and dmin,
    12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles, w = d * sc * q - dmin * m. Q6_K: 256
    weights in 16 sub-blocks of 16, 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 sub-block
    scales sc, fp16 d, w = d * sc * (q - 32).
    """
    rows = data.shape[0]
    if type_name == "Q4_1":
        raw = np.asarray(data).reshape(rows, -1, 20)
        qs = torch.from_numpy(raw[..., 4:].copy())
        return BlockWeight("q4_1", qs, _fp16_field(raw, 0), _fp16_field(raw, 2))
    if type_name == "Q8_0":
        raw = np.asarray(data).reshape(rows, -1, 34)
        qs = torch.from_numpy(raw[..., 2:].copy().view(np.int8))
        return BlockWeight("q8_0", qs, _fp16_field(raw, 0), None)
    if type_name == "Q4_0":
        raw = np.asarray(data).reshape(rows, -1, 18)
        scale = _fp16_field(raw, 0)
        # scale * q - 8 * scale: both products exact, so the sum is scale * (q - 8) rounded once, as gguf's.
        return BlockWeight("q4_1", torch.from_numpy(raw[..., 2:].copy()), scale, scale * -8.0)
    if type_name == "Q4_K":
        return _q4_k_blocks(np.asarray(data).reshape(rows, -1, 144))
    if type_name == "Q6_K":
        return _q6_k_blocks(np.asarray(data).reshape(rows, -1, 210))
    return None


def _q6_k_blocks(raw: np.ndarray) -> BlockWeight:
    """Q6_K super-blocks [rows, n, 210] in the q6_k form: q - 32 as int8 in element order and a scale
    d * sc[j] for each 16 weights (exact in fp32: an fp16 times an int8), computed as gguf computes them."""
    rows, supers = raw.shape[:2]
    ql, qh = raw[..., :128], raw[..., 128:192]
    sc = raw[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, n, 16]
    d = raw[..., 208:210].copy().view(np.float16).astype(np.float32)  # [rows, n, 1]
    # Two halves of 128 weights: in a half, 64 bytes of ql give weights 0-63 by their low nibbles and 64-127
    # by their high ones; 32 bytes of qh give, for weight 32 * g + e, the bits 2g, 2g + 1 of byte e.
    low = ql.reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & np.uint8(0x0F)).reshape(rows, supers, 2, 128)
    high = qh.reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(rows, supers, 2, 128)
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(rows, supers * 8, BLOCK)
    return BlockWeight(
        "q6_k",
        torch.from_numpy(np.ascontiguousarray(q)),
        torch.from_numpy((d * sc).reshape(rows, -1)),
        None,
    )


def _q4_k_blocks(raw: np.ndarray) -> BlockWeight:
    """Q4_K super-blocks [rows, n, 144] as Q4_1-form blocks of 32: sub-block j has scale d * sc[j] and min
    -(dmin * m[j]), both exact in fp32 (an fp16 times a 6-bit integer), computed as gguf computes them."""
    import gguf

    rows, supers = raw.shape[:2]
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, n, 1]
    dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
    scale = d * sc.reshape(rows, supers, 8).astype(np.float32)
    minimum = -(dmin * m.reshape(rows, supers, 8).astype(np.float32))
    # The 128 bytes are 4 groups of 32: a group's low nibbles are sub-block 2g, its high nibbles 2g + 1, each
    # weight e of a sub-block in byte e. The Q4_1 form packs weight i with weight 16 + i into one byte.
    groups = raw[..., 16:].reshape(rows, supers, 4, 1, 32)
    nibbles = (groups >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & np.uint8(0x0F)
    nibbles = nibbles.reshape(rows, supers * 8, 32)
    qs = nibbles[..., :16] | (nibbles[..., 16:] << np.uint8(4))
    return BlockWeight(
        "q4_1",
        torch.from_numpy(np.ascontiguousarray(qs)),
        torch.from_numpy(scale.reshape(rows, -1)),
        torch.from_numpy(minimum.reshape(rows, -1)),
    )


def project(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    blocks: BlockWeight | None,
    dequantized: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x @ weight^T: on the weight's blocks for a few fp32 rows on the CPU (more when they are its only
    copy); else the dense matmul, on the blocks dequantized when no dense weight is kept (None): by
    `dequantized` (a Linear's cache, model.Linear.dense_weight), else for this call; or on a 16-bit weight
    upcast for this call (bf16 -> fp32 is exact: the result equals a weight loaded in fp32)."""
    kernel_rows = MAX_ROWS if weight is not None else MAX_ROWS_WITHOUT_DENSE
    if (
        blocks is not None
        and x.shape[0] <= kernel_rows
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    ):
        return blocks.matmul(x)
    if weight is None:
        if blocks is None:
            raise ValueError("project: neither a dense weight nor blocks")
        weight = dequantized() if dequantized is not None else blocks.dequantize()
    return dense.linear(x, weight.to(x.dtype))
