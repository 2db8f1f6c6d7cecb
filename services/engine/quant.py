"""Weights kept in a GGUF file's own quantized blocks, for the few-row matmuls of decode.

A decode step is bound by the bytes of weights it reads. Dequantized to fp32, SmolLM2's weights are 540 MB;
in their Q4_1/Q8_0 blocks they are about 100 MB. `BlockWeight.matmul` computes x @ W^T in fp32 straight from
the blocks with the C kernels of cpu_kernels.c, so its results equal the dense fp32 matmul up to summation
order. Prefill keeps the dense weights: for hundreds of rows the BLAS matmul is faster.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pcpstack.engine import cpu_kernels

BLOCK = 32
# Up to this many rows (decode batches, short prefill chunks) the block kernels beat the dense matmul here.
MAX_ROWS = 16


@dataclass(frozen=True)
class BlockWeight:
    """A [rows, cols] weight in 32-wide blocks along cols: Q4_1 (w = scale * q + min) or Q8_0 (w = scale * q).

    qs: [rows, cols / 32, 16] uint8 nibbles (Q4_1) or [rows, cols / 32, 32] int8 (Q8_0); scale and minimum:
    [rows, cols / 32] fp32; minimum is None for Q8_0.
    """

    kind: str
    qs: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, cols) of the weight it encodes."""
        return self.qs.shape[0], self.qs.shape[1] * BLOCK

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "BlockWeight":
        """The weight with `fn` applied to the rows of every part (a row permutation, a slice)."""
        minimum = None if self.minimum is None else fn(self.minimum).contiguous()
        return BlockWeight(self.kind, fn(self.qs).contiguous(), fn(self.scale).contiguous(), minimum)

    @staticmethod
    def cat(parts: "list[BlockWeight]") -> "BlockWeight | None":
        """The parts stacked along rows (a fused projection); None when their formats differ."""
        if len({(p.kind, p.shape[1]) for p in parts}) != 1:
            return None
        minimum = None if parts[0].minimum is None else torch.cat([p.minimum for p in parts])
        return BlockWeight(
            parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.scale for p in parts]), minimum
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, cols] fp32 @ W^T -> [m, rows] fp32, on the block kernels."""
        if x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"block matmul: x has shape {tuple(x.shape)}, expected [m, {self.shape[1]}]")
        # Blocks exist only where the engine chose the kernels (weights.py asks cpu_kernels.library()).
        lib = cpu_kernels.build_library()
        if lib is None:
            raise RuntimeError("the CPU block kernels are not available")
        return cpu_kernels.block_matmul(lib, self.kind, x, self.qs, self.scale, self.minimum)


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
            w = projections[name]
            tensors.extend(t for t in (w.qs, w.scale, w.minimum) if t is not None)
            return cpu_kernels.BlockWeightC(
                cpu_kernels.KIND_CODES[w.kind],
                *w.shape,
                *(None if t is None else t.data_ptr() for t in (w.qs, w.scale, w.minimum, bias)),
            )

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
        lib = cpu_kernels.build_library()
        if lib is None:
            raise RuntimeError("the CPU block kernels are not available")
        tables = (slots, block_tables, context_lens)
        return cpu_kernels.decode_layer(lib, self.weights, x, cos, sin, *caches, *tables)


def _fp16_field(raw: np.ndarray, offset: int) -> torch.Tensor:
    return torch.from_numpy(raw[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def from_gguf(data: np.ndarray, type_name: str) -> BlockWeight | None:
    """The blocks of a GGUF tensor's raw bytes ([rows, bytes per row] uint8); None for other formats.

    Q4_1 block: fp16 scale, fp16 min, 16 bytes of nibbles. Q8_0 block: fp16 scale, 32 int8.
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
    return None


def project(x: torch.Tensor, weight: torch.Tensor, blocks: BlockWeight | None) -> torch.Tensor:
    """x @ weight^T: on the weight's blocks for a few fp32 rows on the CPU, else the dense matmul."""
    if blocks is not None and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
        return blocks.matmul(x)
    return torch.nn.functional.linear(x, weight)
