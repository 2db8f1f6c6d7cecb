"""The memory roofline of a decode step: the bytes one step must read against the machine's copy bandwidth.

A decode step of a small model on a CPU is bound by memory traffic: every weight the step uses is streamed
once per step (whatever the batch), and every sequence's K/V is read once. `step_bytes` counts those bytes
for the engine as it is loaded, the way the step reads them: a projection that runs on the C block kernels
at this batch (services/engine/quant.project) reads its quantized blocks, any other reads its dense tensor;
the embedding table is read only for the rows looked up, unless it is also the logits projection (tied);
the K/V read is layers x 2 x context x kv_heads x head_dim x dtype bytes per sequence. `copy_bandwidth`
measures what the machine streams (a torch copy of a large tensor, with the bench's threads), and the
ceiling of a batch is the tokens/s the step would reach if it did nothing but read its bytes at that
bandwidth. Activations, the logits and the cache write of the new token are left out: they are small
against the weights and the context.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from pcpstack.engine import quant
from pcpstack.engine.engine import Engine

COPY_BYTES = 256 * 2**20


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> dict[str, float]:
    """GB/s (1e9 bytes) of a torch copy of an nbytes tensor into another, median and spread of `repeats`
    after one warm-up. Bytes count as read plus written (STREAM's convention for copy)."""
    source = torch.ones(nbytes // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch of the pages, not timed
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        rates.append(2 * nbytes / (time.perf_counter() - started) / 1e9)
    return {
        "bytes": nbytes,
        "gb_s": round(statistics.median(rates), 2),
        "gb_s_min": round(min(rates), 2),
        "gb_s_max": round(max(rates), 2),
    }


def _tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _blocks_bytes(blocks: quant.BlockWeight) -> int:
    """Every tensor part of a quantized weight (nibbles or int8, scales, minimums; a chain's every part)."""
    return blocks.nbytes


def _projection_bytes(
    weight: torch.Tensor | None, blocks: quant.BlockWeight | None, batch: int, device: torch.device
) -> int:
    """What x @ weight^T reads for `batch` rows: the blocks where quant.project runs them (its own
    condition: few fp32 rows on the CPU), else the dense weight."""
    if weight is None:  # kept only in its blocks (services/engine/weights.py)
        return _blocks_bytes(blocks)
    on_blocks = blocks is not None and batch <= quant.MAX_ROWS and weight.dtype == torch.float32
    return _blocks_bytes(blocks) if on_blocks and device.type == "cpu" else _tensor_bytes(weight)


def weight_bytes(engine: Engine, batch: int) -> int:
    """Bytes of weights one decode step of `batch` sequences reads."""
    model, device = engine.model, engine.device
    embedding, output = model.tok_embeddings.weight, model.output_weight()
    counted = {id(embedding), id(output)}
    total = _projection_bytes(output, model.output_blocks, batch, device)  # the logits projection
    if embedding is not None and output is not embedding:  # (None: kept in blocks, a few rows' bytes)
        total += batch * embedding.shape[1] * embedding.element_size()  # only the rows looked up
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model.output:
            total += _projection_bytes(module.weight, getattr(module, "blocks", None), batch, device)
            total += _tensor_bytes(module.bias)
            counted.update({id(module.weight), id(module.bias)})
    # Norm weights and any other parameter, read whole.
    return total + sum(_tensor_bytes(p) for p in model.parameters() if id(p) not in counted)


def kv_bytes(engine: Engine, batch: int, context: float) -> int:
    """Bytes of K/V one decode step of `batch` sequences of `context` tokens reads."""
    layout = engine.layout
    itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
    per_token = layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * itemsize
    return int(per_token * context * batch)


def step_bytes(engine: Engine, batch: int, context: float) -> dict[str, int]:
    """Weight, K/V and total bytes one decode step reads."""
    weights, kv = weight_bytes(engine, batch), kv_bytes(engine, batch, context)
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes_per_step": weights + kv}


def mean_context(context: int, timed_steps: int) -> float:
    """The mean context of bench engine's timed steps: one warm-up step after the prompt of `context`
    tokens, then `timed_steps` steps, each attending one token more than the last."""
    first = context + 2  # the prompt, the warm-up step's token and the step's own
    return first + (timed_steps - 1) / 2


def add_roofline(engine: Engine, result: dict, timed_steps: int) -> dict:
    """bench engine's result with "roofline": the copy bandwidth and, per decode batch of result["decode"]
    ({"batch_B": {"context", "tokens_per_s", ...}}), the bytes a step reads at the timed steps' mean
    context, the bandwidth-bound ceiling in tokens/s and the fraction of it the measured rate reached."""
    bandwidth = copy_bandwidth()
    rows = {}
    for key, measured in result["decode"].items():
        batch = int(key.removeprefix("batch_"))
        context = mean_context(measured["context"], timed_steps)
        read = step_bytes(engine, batch, context)
        ceiling = batch * bandwidth["gb_s"] * 1e9 / read["bytes_per_step"]
        rows[key] = {
            "mean_context": context,
            **read,
            "ceiling_tokens_per_s": round(ceiling, 1),
            "fraction_of_ceiling": round(measured["tokens_per_s"] / ceiling, 3),
        }
    return {**result, "roofline": {"copy": bandwidth, "batches": rows}}
