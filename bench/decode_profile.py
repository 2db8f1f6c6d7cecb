"""Where a decode step's time goes: its projections and its attention, each timed alone on the engine's own
weights and K/V, against the whole step.

The fused step (services/engine/cpu_kernels.c, decode_model) is one C call, so its parts cannot be timed
from inside without changing it. Here each part runs again by itself, with the same kernels and threads:
every projection the step multiplies (each layer's and the logits projection) on the blocks it holds, on
random rows of the batch's size, and the paged attention of every layer over the batch's real block tables
and context lengths, with random queries. What is left of the measured step is the rest: norms, RoPE,
SiLU, the cache writes, the threads waiting for each other between the parts, and the Python around the
call. Each part timed alone starts one team of threads per call (about 150 calls a step for SmolLM2),
which the fused step does not: a part's share comes out a little high, never low.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from pcpstack.engine import cpu_kernels, quant
from pcpstack.engine.engine import Engine
from pcpstack.engine.model import Linear


def _projections(engine: Engine) -> list[quant.BlockWeight]:
    """The blocks of every projection the fused step multiplies, the logits projection last."""
    blocks = [m.blocks for m in engine.model.modules() if isinstance(m, Linear) and m.blocks is not None]
    return [*blocks, engine.model.output_blocks]


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: first touch of buffers, the kernels' team of threads
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def profile_step(
    engine: Engine, seq_ids: Sequence[Hashable], step_ms: float, repeats: int = 5
) -> dict | None:
    """Projections, attention and the rest of a decode step of `seq_ids` (sequences the engine holds, as
    they stand now) that took `step_ms`; None where the step does not run on the C kernels."""
    lib = cpu_kernels.library()
    if lib is None or engine.model.decode_kernel is None or engine.dcp.size > 1:
        return None
    batch = len(seq_ids)
    generator = torch.Generator().manual_seed(0)
    blocks = _projections(engine)
    inputs = [torch.randn(batch, b.shape[1], generator=generator) for b in blocks]

    def projections() -> None:
        for weight, x in zip(blocks, inputs, strict=True):
            weight.matmul(x)

    args = engine.args
    states = [engine.sequences[s] for s in seq_ids]
    width = max(len(s.block_table) for s in states)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in states])
    lens = torch.tensor([s.num_tokens for s in states])
    q = torch.randn(batch, args.n_heads, args.head_dim, generator=generator)
    layers = [engine.cache.layer(i) for i in range(args.n_layers)]
    k_row = layers[0][0][0, 0]  # one token's K: kv_heads x head_dim

    def attention() -> None:
        for k_cache, v_cache in layers:
            cpu_kernels.paged_decode_attention(lib, q, k_cache, v_cache, tables, lens)

    projections_ms = _median_ms(projections, repeats)
    attention_ms = _median_ms(attention, repeats)
    return {
        "step_ms": step_ms,
        "projections_ms": projections_ms,
        "attention_ms": attention_ms,
        "rest_ms": step_ms - projections_ms - attention_ms,
        "mean_context": float(lens.float().mean()),
        "projection_flops": sum(2 * batch * b.shape[0] * b.shape[1] for b in blocks),
        # K and V of every layer for each sequence's tokens
        "kv_bytes": int(lens.sum()) * 2 * args.n_layers * k_row.numel() * k_row.element_size(),
    }
