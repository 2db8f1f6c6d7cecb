"""Weights kept "cached" (services/engine/weights.py, the default): a GGUF's projections in their blocks, and
each projection's fp32 weight kept from the first input long enough to need it, so a prefill rank no longer
dequantizes every projection again in every forward."""

import pytest
import torch

from pcpstack.engine.engine import Engine
from pcpstack.engine.model import Linear
from pcpstack.engine.quant import MAX_ROWS_WITHOUT_DENSE, BlockWeight
from pcpstack.engine.weights import WEIGHTS_ENV, LoadedModel, load_model, weights_form
from tests.engine.conftest import engine_logits

LONG = MAX_ROWS_WITHOUT_DENSE + 72  # past the block kernels' rows: the projections run dense
SHORT = 40


def _prompt(length: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def _linears(loaded: LoadedModel) -> list[Linear]:
    return [module for module in loaded.model.modules() if isinstance(module, Linear)]


@pytest.fixture(scope="module")
def stored() -> LoadedModel:
    return load_model(None, "cpu", torch.float32, weights="stored")


@pytest.fixture
def cached() -> LoadedModel:
    return load_model(None, "cpu", torch.float32, weights="cached")


def test_weights_are_cached_unless_a_setting_says_otherwise(monkeypatch):
    monkeypatch.delenv(WEIGHTS_ENV, raising=False)
    assert weights_form() == "cached"
    monkeypatch.setenv(WEIGHTS_ENV, "stored")
    assert weights_form() == "stored"


def test_cached_weights_prefill_the_logits_of_stored_weights_bit_for_bit(cached, stored):
    vocab = cached.args.vocab_size
    cached_engine, stored_engine = (Engine(m, block_size=16, num_blocks=64) for m in (cached, stored))
    long_prompt = _prompt(LONG, vocab)
    reference = engine_logits(stored_engine, long_prompt)
    # The first long prompt dequantizes and keeps each projection, the second runs on what was kept: the
    # same values in the same BLAS calls as a dequantization per forward.
    assert torch.equal(engine_logits(cached_engine, long_prompt), reference)
    assert torch.equal(engine_logits(cached_engine, long_prompt), reference)
    short_prompt = _prompt(SHORT, vocab)  # both on the block kernels
    assert torch.equal(engine_logits(cached_engine, short_prompt), engine_logits(stored_engine, short_prompt))


def test_cached_weights_dequantize_each_projection_once_and_only_for_a_long_input(cached):
    engine = Engine(cached, block_size=16, num_blocks=64)
    linears = _linears(cached)
    engine_logits(engine, _prompt(SHORT, cached.args.vocab_size))
    assert all(linear.dequantized is None for linear in linears)  # a decoding process holds none
    engine_logits(engine, _prompt(LONG, cached.args.vocab_size))
    kept = [linear.dequantized for linear in linears]
    assert all(linear.weight is None for linear in linears)  # the loaded weights are still only blocks
    assert all(torch.equal(w, linear.blocks.dequantize()) for w, linear in zip(kept, linears, strict=True))
    engine_logits(engine, _prompt(LONG + 1, cached.args.vocab_size))
    assert all(linear.dequantized is w for w, linear in zip(kept, linears, strict=True))
    # SmolLM2: 30 layers of 3,538,944 projection weights (qkv 960 x 576, wo 576 x 576, gate/up 3,072 x 576,
    # down 576 x 1,536) in fp32; the embedding and the tied LM head stay in blocks.
    assert sum(w.nbytes for w in kept) == 30 * 3_538_944 * 4
    assert cached.model.tok_embeddings.weight is None and cached.model.output_weight() is None


def test_a_prefill_process_holds_each_projection_dense_from_load(stored, monkeypatch):
    """load_model(prefill=True), as a prefill rank loads: each projection's fp32 weight is made at load (a
    rank needs it for its first long prompt anyway), so short inputs too (a warm turn's few dozen new
    tokens) take the dense matmul from the first request on, whatever ran before; decode's blocks stay."""
    loaded = load_model(None, "cpu", torch.float32, weights="cached", prefill=True)
    linears = _linears(loaded)
    assert all(linear.weight is not None and linear.dequantized is None for linear in linears)
    assert all(torch.equal(linear.weight, linear.blocks.dequantize()) for linear in linears)
    assert sum(linear.weight.nbytes for linear in linears) == 30 * 3_538_944 * 4
    engine, stored_engine = (Engine(m, block_size=16, num_blocks=64) for m in (loaded, stored))
    vocab = loaded.args.vocab_size
    long_prompt = _prompt(LONG, vocab)  # the same values in the same dense calls as stored weights
    assert torch.equal(engine_logits(engine, long_prompt), engine_logits(stored_engine, long_prompt))

    projections = {id(linear.blocks) for linear in [*linears, *_linears(stored)]}
    block_calls = []
    original = BlockWeight.matmul

    def counted(self: BlockWeight, x: torch.Tensor) -> torch.Tensor:
        block_calls.append(id(self) in projections)
        return original(self, x)

    monkeypatch.setattr(BlockWeight, "matmul", counted)
    short_prompt = _prompt(SHORT, vocab)
    reference = engine_logits(stored_engine, short_prompt)  # on the block kernels
    assert block_calls.count(True) == 30 * 4  # qkv, wo, gate/up, down of each layer
    block_calls.clear()
    logits = engine_logits(engine, short_prompt)
    assert block_calls.count(True) == 0  # every projection dense
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    assert torch.allclose(logits, reference, atol=2e-3, rtol=0)  # another summation order only


def test_stored_weights_dequantize_for_each_long_input_and_keep_nothing(stored):
    engine = Engine(stored, block_size=16, num_blocks=64)
    engine_logits(engine, _prompt(LONG, stored.args.vocab_size))
    assert all(linear.dequantized is None for linear in _linears(stored))


def test_an_unknown_weights_setting_is_refused_naming_every_form():
    with pytest.raises(ValueError, match=r"weights='int4': expected one of 'cached' .*'stored' .*'dense'"):
        load_model("tiny", "cpu", weights="int4")
