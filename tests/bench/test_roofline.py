"""The decode roofline's byte count on the tiny model, dense and with a projection in quantized blocks."""

from __future__ import annotations

import pytest
import torch

from bench.roofline import copy_bandwidth, step_bytes
from pcpstack.engine.engine import Engine
from pcpstack.engine.quant import BLOCK, MAX_ROWS, BlockWeight


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return Engine.load("tiny", block_size=16, num_blocks=8)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def test_decode_step_reads_every_dense_weight_once_and_each_sequences_kv(tiny) -> None:
    args, model = tiny.args, tiny.model
    assert model.output is None  # tied: the embedding is the logits projection, read whole
    read = step_bytes(tiny, batch=4, context=100)
    assert read["weight_bytes"] == sum(_bytes(p) for p in model.parameters())
    # layers x K and V x 100 tokens x kv heads x head_dim x fp32, for each of 4 sequences
    assert read["kv_bytes"] == args.n_layers * 2 * 100 * args.n_kv_heads * args.head_dim * 4 * 4
    assert read["bytes_per_step"] == read["weight_bytes"] + read["kv_bytes"]


def test_a_projection_in_blocks_counts_its_blocks_up_to_the_kernels_row_limit(tiny) -> None:
    linear = tiny.model.layers[0].feed_forward.w2
    rows, cols = linear.weight.shape
    blocks = BlockWeight(
        "q8_0",
        torch.zeros(rows, cols // BLOCK, BLOCK, dtype=torch.int8),
        torch.ones(rows, cols // BLOCK),
        None,
    )
    dense = step_bytes(tiny, batch=1, context=10)["weight_bytes"]
    linear.blocks = blocks
    try:
        on_blocks = step_bytes(tiny, batch=MAX_ROWS, context=10)["weight_bytes"]
        over_limit = step_bytes(tiny, batch=MAX_ROWS + 1, context=10)["weight_bytes"]
    finally:
        linear.blocks = None
    assert on_blocks == dense - _bytes(linear.weight) + _bytes(blocks.qs) + _bytes(blocks.scale)
    assert over_limit == dense  # more rows than the kernels take: the dense matmul reads the dense weight


def test_copy_bandwidth_reports_a_positive_median_inside_its_spread() -> None:
    copy = copy_bandwidth(nbytes=8 * 2**20, repeats=3)
    assert 0 < copy["gb_s_min"] <= copy["gb_s"] <= copy["gb_s_max"]
    assert copy["bytes"] == 8 * 2**20
