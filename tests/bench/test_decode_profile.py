"""The decode step profile: its parts timed on the engine's own blocks and K/V; none without the kernels."""

from __future__ import annotations

import pytest

from bench.decode_profile import profile_step
from pcpstack.engine import cpu_kernels
from pcpstack.engine.engine import Engine


def test_a_step_on_the_kernels_splits_into_projections_attention_and_the_rest() -> None:
    if cpu_kernels.library() is None:
        pytest.skip("no C kernels on this machine")
    engine = Engine.load(None, block_size=16, num_blocks=16)
    args = engine.args
    lengths = (40, 9)
    seqs = [("profile", n) for n in lengths]
    for seq, n in zip(seqs, lengths, strict=True):
        engine.prefill(seq, list(range(1, n + 1)))
    assert engine.model.decode_kernel is not None
    profile = profile_step(engine, seqs, step_ms=50.0, repeats=2)
    assert profile is not None
    assert profile["projections_ms"] > 0 and profile["attention_ms"] > 0
    assert profile["rest_ms"] == pytest.approx(50.0 - profile["projections_ms"] - profile["attention_ms"])
    assert profile["mean_context"] == sum(lengths) / 2
    # Every layer's projections and the logits projection (tied: the embedding), 2 flops a weight a row.
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_layer = args.dim * (q + 2 * kv) + q * args.dim + 3 * args.dim * args.hidden_dim
    weights = args.n_layers * per_layer + args.vocab_size * args.dim
    assert profile["projection_flops"] == 2 * len(seqs) * weights
    # K and V of every layer for each sequence's tokens, fp32
    assert profile["kv_bytes"] == sum(lengths) * 2 * args.n_layers * kv * 4


def test_a_step_without_the_kernels_has_no_profile() -> None:
    engine = Engine.load("tiny", block_size=16, num_blocks=8)  # dense weights: the step runs on PyTorch
    engine.prefill("s", [1, 2, 3])
    assert profile_step(engine, ["s"], step_ms=1.0) is None
