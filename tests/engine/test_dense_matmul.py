"""engine/dense.py: the fp32 dense matmuls of prefill on torch's own matmul or on oneDNN's, whichever is
faster on this CPU (kept per machine), or as PCPSTACK_DENSE_MATMUL says; both give the dense product up to
fp32 summation order, and the engine's prefill gives the same logits either way."""

from __future__ import annotations

import json

import pytest
import torch

from pcpstack.common import native
from pcpstack.common.config import ConfigError
from pcpstack.engine import attention, dense
from pcpstack.engine.engine import Engine

needs_onednn = pytest.mark.skipif(not dense.onednn_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The choice made afresh with an empty verdict cache, and again after the test."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(dense.DENSE_MATMUL_ENV, raising=False)
    dense.use_onednn.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    dense.use_onednn.cache_clear()


@needs_onednn
@pytest.mark.parametrize("choice", ["torch", "onednn"])
@pytest.mark.parametrize(
    ("rows", "cols", "out"), [(1, 7, 3), (17, 576, 1536), (300, 1536, 576), (64, 33, 65)]
)
def test_linear_equals_the_dense_product_on_either_library(fresh, choice, rows, cols, out) -> None:
    fresh.setenv(dense.DENSE_MATMUL_ENV, choice)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    weight = torch.randn(out, cols, generator=generator, dtype=torch.float64)
    got = dense.linear(x.float(), weight.float())
    assert dense.use_onednn() is (choice == "onednn")
    # Against the float64 product: no further off than torch's own fp32 matmul is, give or take its order.
    exact = x @ weight.T
    torch_error = (torch.nn.functional.linear(x.float(), weight.float()).double() - exact).abs().max()
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    assert (got.double() - exact).abs().max() <= 3 * torch_error + 1e-6


@needs_onednn
def test_linear_takes_batched_and_strided_inputs_on_onednn(fresh) -> None:
    fresh.setenv(dense.DENSE_MATMUL_ENV, "onednn")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 96, generator=generator)[:, ::2]  # [2, 20, 96], not contiguous
    weight = torch.randn(96, 50, generator=generator).T  # [50, 96], not contiguous
    got = dense.linear(x, weight)
    assert got.shape == (2, 20, 50)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_other_dtypes_stay_on_torchs_matmul(fresh) -> None:
    fresh.setenv(dense.DENSE_MATMUL_ENV, "torch")
    x, weight = torch.ones(3, 8, dtype=torch.float64), torch.ones(5, 8, dtype=torch.float64)
    assert torch.equal(dense.linear(x, weight), torch.full((3, 5), 8.0, dtype=torch.float64))


@needs_onednn
def test_the_verdict_is_measured_once_and_kept_for_every_later_process(fresh, tmp_path) -> None:
    assert dense.use_onednn() in (True, False)
    [kept] = tmp_path.glob("dense-matmul-*.json")
    verdict = json.loads(kept.read_text())
    assert verdict["agree"] is True and verdict["torch_gflops"] > 0 and verdict["onednn_gflops"] > 0
    assert verdict["use_onednn"] is (verdict["torch_gflops"] * dense.MIN_SPEEDUP <= verdict["onednn_gflops"])
    # A later process reads it rather than measuring: the kept answer stands even where a measurement
    # would say otherwise.
    kept.write_text(json.dumps({**verdict, "use_onednn": not verdict["use_onednn"]}))
    fresh.setattr(dense, "measure", lambda: pytest.fail("measured again"))
    dense.use_onednn.cache_clear()
    assert dense.use_onednn() is (not verdict["use_onednn"])


@needs_onednn
@pytest.mark.parametrize(
    ("timings", "chosen"),
    [
        ((2.0, 1.0, True), True),  # twice as fast
        ((1.05, 1.0, False), False),  # faster but disagrees
        ((1.05, 1.0, True), False),  # within the margin: stays on torch's
        ((1.0, 2.0, True), False),  # slower
    ],
)
def test_onednn_is_chosen_only_when_it_agrees_and_wins_by_the_margin(fresh, timings, chosen) -> None:
    fresh.setattr(dense, "measure", lambda: timings)
    assert dense.use_onednn() is chosen


def test_an_unknown_setting_is_refused_naming_the_variable_and_its_values(fresh) -> None:
    fresh.setenv(dense.DENSE_MATMUL_ENV, "mkl")
    with pytest.raises(ConfigError, match="PCPSTACK_DENSE_MATMUL='mkl': must be one of: unset") as info:
        dense.use_onednn()
    assert "torch (" in str(info.value) and "onednn (" in str(info.value)


def test_onednn_forced_where_torch_lacks_it_is_refused_when_the_model_loads(fresh) -> None:
    """A torch without oneDNN cannot be had here: its absence is stood in for by onednn_available."""
    fresh.setenv(dense.DENSE_MATMUL_ENV, "onednn")
    fresh.setattr(dense, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="PCPSTACK_DENSE_MATMUL='onednn': needs oneDNN"):
        Engine.load("tiny")


@needs_onednn
def test_prefill_logits_are_the_same_on_either_library(fresh) -> None:
    ids = torch.randint(3, 256, (700,), generator=torch.Generator().manual_seed(1)).tolist()
    logits, onednn_calls = {}, []
    real = dense.onednn_linear
    fresh.setattr(dense, "onednn_linear", lambda x, weight: onednn_calls.append(x.shape) or real(x, weight))
    for choice in ("torch", "onednn"):
        fresh.setenv(dense.DENSE_MATMUL_ENV, choice)
        dense.use_onednn.cache_clear()
        engine = Engine.load("tiny")
        assert dense.use_onednn() is (choice == "onednn")
        onednn_calls.clear()
        logits[choice] = engine.prefill("s", ids)
        # The chosen library, and only it, took the prompt's projections (all 700 rows), the last token's
        # logits, and attention's products: the tiny model's 2 query heads a K/V head times a block of
        # 128 queries, and of the last 60.
        expected = {len(ids), 1, 2 * attention.ONEDNN_BLOCK, 2 * 60} if choice == "onednn" else set()
        assert {shape[0] for shape in onednn_calls} == expected
    torch.testing.assert_close(logits["onednn"], logits["torch"], rtol=1e-4, atol=1e-4)
    assert logits["onednn"].argmax() == logits["torch"].argmax()
