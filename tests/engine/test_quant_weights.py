"""Weights kept in their stored form (services/engine/quant.py, weights.py): every block type dequantizes to
gguf's own values, a model whose projections live only in blocks computes what its dense load computes (a
Q4_K_M-like file's mixed Q4_K/Q6_K projections and F16 ones included), and 16-bit safetensors stay 16-bit
with the fp32 load's results."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.engine_weights import Q4_K_M, random_q4_k, random_q6_k, write_synthetic_gguf
from pcpstack.engine import cpu_kernels
from pcpstack.engine.dense import linear as dense_linear
from pcpstack.engine.engine import Engine
from pcpstack.engine.gguf_file import read_gguf
from pcpstack.engine.model import Linear
from pcpstack.engine.parallel import TensorParallelShard
from pcpstack.engine.quant import MAX_ROWS_WITHOUT_DENSE, BlockWeight, from_gguf
from pcpstack.engine.weights import (
    WEIGHTS_ENV,
    _read_gguf_shard,
    default_model_path,
    load_model,
    unpermute_qk,
)
from tests.engine.conftest import engine_logits
from tests.helpers import small_hf_llama

Q = gguf.GGMLQuantizationType
SMALL = {"dim": 64, "layers": 2, "hidden": 96, "heads": 4, "kv_heads": 2, "vocab": 256}


# Random super-blocks with any bits and finite fp16 scales of either sign.
D_RANGE = (-0.05, 0.05)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_every_block_type_dequantizes_to_the_values_gguf_gives(kind):
    rng = np.random.default_rng(int(kind))
    dense = rng.standard_normal((24, 512)).astype(np.float32)
    random_bytes = {Q.Q4_K: random_q4_k, Q.Q6_K: random_q6_k}.get(kind)
    data = random_bytes(rng, 24, 512, D_RANGE) if random_bytes else gguf.quants.quantize(dense, kind)
    expected = gguf.quants.dequantize(data, kind)
    blocks = from_gguf(data, kind.name)
    got = blocks.dequantize().numpy()
    # Bit for bit, but for zero's sign: Q4_0 as scale * q - 8 * scale gives +0 where gguf's d * (q - 8) gives
    # -0 for a negative d (equal values: every sum they enter is the same).
    differ = got.view(np.uint32) != expected.view(np.uint32)
    assert not (differ & ~((got == 0) & (expected == 0))).any()
    rows = torch.tensor([5, 0, 5, 23])
    assert np.array_equal(blocks.dequantize(rows).numpy(), expected[rows.numpy()])
    # A PCP rank's share of a short prompt may be empty.
    assert blocks.dequantize(torch.tensor([], dtype=torch.long)).shape == (0, 512)


def test_a_projection_of_mixed_block_types_is_a_chain_that_multiplies_as_its_parts():
    rng = np.random.default_rng(2)
    q4_k, q6_k = random_q4_k(rng, 40, 512, D_RANGE), random_q6_k(rng, 24, 512, D_RANGE)
    fused = BlockWeight.cat([from_gguf(q4_k, "Q4_K"), from_gguf(q6_k, "Q6_K")])
    assert (fused.kind, fused.next.kind, fused.shape) == ("q4_1", "q6_k", (64, 512))
    parts = (gguf.quants.dequantize(q4_k, Q.Q4_K), gguf.quants.dequantize(q6_k, Q.Q6_K))
    dense = torch.from_numpy(np.concatenate(parts))
    assert torch.equal(fused.dequantize(), dense)
    assert torch.equal(fused.columns(slice(96, 224)).dequantize(), dense[:, 96:224])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    # Against the float64 product (sums up to ~2,400 here): an fp32 matmul's own rounding is ~5e-4 at that
    # size, whichever its order (torch's was, on an AMD EPYC), while a part in the wrong rows is off ~1,000.
    exact = x.double() @ dense.double().T
    torch.testing.assert_close(fused.matmul(x).double(), exact, atol=1e-6 * exact.abs().max(), rtol=1e-5)


def test_a_projection_only_in_blocks_runs_long_prompts_on_its_dequantized_weight():
    tensor = gguf.quants.quantize(
        np.random.default_rng(1).standard_normal((96, 64)).astype(np.float32), Q.Q4_1
    )
    linear = Linear(64, 96, bias=False)
    linear.keep_blocks(from_gguf(tensor, "Q4_1"), dense=False)
    assert linear.weight is None
    weight = torch.from_numpy(gguf.quants.dequantize(tensor, Q.Q4_1))
    generator = torch.Generator().manual_seed(0)
    long_rows = torch.randn(MAX_ROWS_WITHOUT_DENSE + 1, 64, generator=generator)
    # The engine's dense matmul (engine/dense.py: torch's or oneDNN's, as this machine chose) on equal values.
    assert torch.equal(linear(long_rows), dense_linear(long_rows, weight))
    short_rows = long_rows[:MAX_ROWS_WITHOUT_DENSE]  # the block kernel: another summation order
    torch.testing.assert_close(linear(short_rows), F.linear(short_rows, weight), atol=1e-5, rtol=1e-5)


def test_smollm2_keeps_projections_embedding_and_lm_head_only_in_blocks_with_gguf_values(smollm):
    model, args = smollm.model, smollm.args
    assert model.tok_embeddings.weight is None and model.output_weight() is None
    assert all(m.weight is None for m in model.modules() if isinstance(m, Linear))
    tensors = {t.name: t for t in read_gguf(default_model_path()).tensors}

    def gguf_dense(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    for i in (0, args.n_layers - 1):
        blk, layer = f"blk.{i}.", model.layers[i]
        q = unpermute_qk(gguf_dense(f"{blk}attn_q.weight"), args.n_heads)
        k = unpermute_qk(gguf_dense(f"{blk}attn_k.weight"), args.n_kv_heads)
        assert torch.equal(
            layer.attention.wqkv.dense_weight(), torch.cat((q, k, gguf_dense(f"{blk}attn_v.weight")))
        )
        assert torch.equal(layer.attention.wo.dense_weight(), gguf_dense(f"{blk}attn_output.weight"))
        gate_up = torch.cat((gguf_dense(f"{blk}ffn_gate.weight"), gguf_dense(f"{blk}ffn_up.weight")))
        assert torch.equal(layer.feed_forward.w13.dense_weight(), gate_up)
        assert torch.equal(layer.feed_forward.w2.dense_weight(), gguf_dense(f"{blk}ffn_down.weight"))
    ids = torch.tensor([0, 17, args.vocab_size - 1, 17])
    assert torch.equal(model.tok_embeddings(ids), gguf_dense("token_embd.weight")[ids])
    assert model.output_blocks is model.tok_embeddings.blocks  # tied: one copy serves both


def test_a_tp_shard_keeps_in_blocks_the_projections_whose_cut_falls_on_block_edges():
    # TP=9 on SmolLM2: one head of 64 rows / columns (on block edges), and 1,536 / 9 of the MLP (not).
    shard = TensorParallelShard(4, 9)
    _, dense, _, no_blocks = _read_gguf_shard(default_model_path(), True, shard)
    _, state, _, blocks = _read_gguf_shard(default_model_path(), True, shard, keep_blocks=True)
    assert no_blocks == {}
    assert "layers.0.attention.wqkv" in blocks and "layers.0.attention.wo" in blocks
    assert "layers.0.feed_forward.w2" not in blocks and "layers.0.feed_forward.w2.weight" in state
    for name, kept in blocks.items():
        key = "tok_embeddings.weight" if name == "output" else f"{name}.weight"
        assert key not in state
        assert torch.equal(kept.dequantize(), dense[key]), name


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "small.Q4_1.gguf", SMALL)


def test_a_gguf_kept_in_blocks_gives_the_logits_of_its_dense_load(small_gguf):
    stored = load_model(small_gguf, "cpu", torch.float32, weights="stored")
    dense = load_model(small_gguf, "cpu", torch.float32, weights="dense")
    assert stored.model.layers[0].feed_forward.w13.weight is None
    assert dense.model.layers[0].feed_forward.w13.weight is not None
    assert dense.model.layers[0].feed_forward.w13.blocks is not None  # decode still runs on blocks
    prompt = torch.randint(
        0, SMALL["vocab"], (MAX_ROWS_WITHOUT_DENSE + 40,), generator=torch.Generator().manual_seed(3)
    )
    stored_engine, dense_engine = (Engine(f, block_size=16, num_blocks=64) for f in (stored, dense))
    long_logits = engine_logits(stored_engine, prompt.tolist())
    # Past the kernels' row limit both run BLAS on equal fp32 weights: the same logits, bit for bit.
    assert torch.equal(long_logits, engine_logits(dense_engine, prompt.tolist()))
    short = prompt[:40].tolist()
    torch.testing.assert_close(
        engine_logits(stored_engine, short), engine_logits(dense_engine, short), atol=1e-4, rtol=0
    )


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    """A Q4_K_M-like GGUF: Q4_K with Q6_K value and down projections and tied embedding, and one F16
    projection (layer 1's output: that layer runs without the fused decode layer)."""
    folder = tmp_path_factory.mktemp("gguf")
    shape = {"dim": 256, "layers": 2, "hidden": 768, "heads": 4, "kv_heads": 2, "vocab": 256}
    types = {**Q4_K_M, "blk.1.attn_output": "F16"}
    return write_synthetic_gguf(folder / "small.Q4_K_M.gguf", shape, types=types)


def test_a_q4_k_m_gguf_kept_stored_gives_the_logits_of_its_dense_load(q4_k_m_gguf):
    stored = load_model(q4_k_m_gguf, "cpu", torch.float32, weights="stored")
    dense = load_model(q4_k_m_gguf, "cpu", torch.float32, weights="dense")
    first, second = stored.model.layers
    assert first.attention.wqkv.weight is None and first.attention.wqkv.blocks.next.kind == "q6_k"
    assert first.feed_forward.w2.blocks.kind == "q6_k" and stored.model.tok_embeddings.blocks.kind == "q6_k"
    assert first.decode_kernel is not None  # the fused decode layer runs the Q4_K|Q6_K chain
    assert second.attention.wo.weight.dtype == torch.float16
    assert dense.model.layers[1].attention.wo.weight.dtype == torch.float32
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (MAX_ROWS_WITHOUT_DENSE + 8,), generator=generator).tolist()
    stored_engine, dense_engine = (Engine(f, block_size=16, num_blocks=64) for f in (stored, dense))
    # Past the kernels' row limit both run BLAS on equal fp32 weights: the same logits, bit for bit.
    assert torch.equal(engine_logits(stored_engine, prompt), engine_logits(dense_engine, prompt))
    short = prompt[:40]
    torch.testing.assert_close(
        engine_logits(stored_engine, short), engine_logits(dense_engine, short), atol=1e-4, rtol=0
    )
    # Decode steps on the kernels (the fused layer, the block matmuls) against a dense prefill of the same
    # tokens (more rows than the kernels take with a dense weight beside them: BLAS).
    with torch.inference_mode():
        stored_engine.prefill("s", short[:20])
        steps = torch.cat([stored_engine.decode_step(["s"], [token]) for token in short[20:24]])
    torch.testing.assert_close(steps, engine_logits(dense_engine, short[:24])[20:], atol=1e-4, rtol=0)


def test_a_tp_shard_of_a_q4_k_m_gguf_keeps_its_q6_k_cut_mid_super_block_in_blocks(q4_k_m_gguf):
    # TP=2: the down projection's 384 columns of 768 end in the middle of a 256-wide Q6_K super-block.
    shard = TensorParallelShard(1, 2)
    _, dense, _, _ = _read_gguf_shard(q4_k_m_gguf, True, shard)
    _, state, _, blocks = _read_gguf_shard(q4_k_m_gguf, True, shard, keep_blocks=True, keep_16bit=True)
    assert blocks["layers.0.feed_forward.w2"].kind == "q6_k"
    assert state["layers.1.attention.wo.weight"].dtype == torch.float16
    for name, kept in blocks.items():
        key = "tok_embeddings.weight" if name == "output" else f"{name}.weight"
        assert torch.equal(kept.dequantize(), dense[key]), name
    assert torch.equal(state["layers.1.attention.wo.weight"].float(), dense["layers.1.attention.wo.weight"])


def test_a_gguf_is_dense_with_a_log_line_when_the_kernels_are_off(small_gguf, monkeypatch, caplog):
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, "0")
    cpu_kernels.build_library.cache_clear()
    cpu_kernels.library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="pcpstack.engine.weights"):
            loaded = load_model(small_gguf, "cpu", torch.float32)
        assert all(
            m.weight is not None and m.blocks is None for m in loaded.model.modules() if isinstance(m, Linear)
        )
        assert "are dense: the CPU block kernels are not in use" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_kernels.build_library.cache_clear()
        cpu_kernels.library.cache_clear()


def test_bf16_safetensors_stay_bf16_and_give_the_logits_of_an_fp32_load(tmp_path):
    small_hf_llama(tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
    stored = load_model(tmp_path, "cpu", torch.float32)
    dense = load_model(tmp_path, "cpu", torch.float32, weights="dense")
    assert stored.model.layers[0].attention.wqkv.weight.dtype == torch.bfloat16
    assert stored.model.tok_embeddings.weight.dtype == torch.bfloat16
    assert dense.model.layers[0].attention.wqkv.weight.dtype == torch.float32
    ids = list(range(1, 60))
    # bf16 -> fp32 is exact, so the upcast per matmul computes on the very weights the fp32 load holds.
    assert torch.equal(
        engine_logits(Engine(stored, block_size=16, num_blocks=8), ids),
        engine_logits(Engine(dense, block_size=16, num_blocks=8), ids),
    )


def test_an_unknown_weights_setting_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(WEIGHTS_ENV, "int4")
    with pytest.raises(
        ValueError, match=r"PCPSTACK_WEIGHTS='int4': expected one of 'cached' .*'stored' .*'dense'"
    ):
        load_model("tiny", "cpu")
