"""The run-wise causal kernel (attention.attend_runs) against dense masked attention: queries in runs of
consecutive positions, cut into diagonal blocks, attend to a whole prompt's K/V exactly as one masked
softmax over every key at or before each query would, on either library's products (engine.dense): torch's
flash kernel, or from ONEDNN_MIN_KEYS keys on oneDNN's matmuls."""

import pytest
import torch
import torch.nn.functional as F

from pcpstack.engine import attention, dense
from pcpstack.engine.attention import DIAGONAL_BLOCK, ONEDNN_BLOCK, attend_runs, position_runs
from pcpstack.prefill.split import DualChunkSplit

ATOL = 1e-5
N_HEADS, N_KV_HEADS, HEAD_DIM = 6, 2, 16


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """q [n, H, D] at `positions` over k, v [ctx, kv_heads, D]: one masked softmax per query, [n, H * D]."""
    group = N_HEADS // N_KV_HEADS
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    visible = torch.arange(k.shape[0])[None] <= positions[:, None]  # [n, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible
    )  # [H, n, D]
    return out.transpose(0, 1).reshape(len(positions), N_HEADS * HEAD_DIM)


@pytest.fixture(params=["torch", "onednn"])
def library(request, monkeypatch):
    """PCPSTACK_DENSE_MATMUL set to each library in turn (oneDNN only where this torch has it)."""
    if request.param == "onednn" and not dense.onednn_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setenv(dense.DENSE_MATMUL_ENV, request.param)
    dense.use_onednn.cache_clear()
    yield request.param
    monkeypatch.undo()
    dense.use_onednn.cache_clear()


def random_qkv(context: int, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(context)
    q = torch.randn(len(positions), N_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(context, N_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(context, N_KV_HEADS, HEAD_DIM, generator=generator)
    return q, k, v


@pytest.mark.parametrize("block", [7, 64, None])
@pytest.mark.parametrize("context", [1, 5, 300, 601])
def test_a_whole_prompt_in_blocks_equals_masked_attention(library, context: int, block: int | None) -> None:
    positions = list(range(context))
    q, k, v = random_qkv(context, positions)
    got = attend_runs(q, k, v, [(0, context)], N_HEADS // N_KV_HEADS, block=block)
    torch.testing.assert_close(got, dense_reference(q, k, v, torch.tensor(positions)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("pcp", [2, 3])
@pytest.mark.parametrize("context", [3, 17, 777, 1031])
def test_each_dual_chunk_share_equals_masked_attention(library, context: int, pcp: int) -> None:
    split = DualChunkSplit(context, pcp)
    for rank in range(pcp):
        positions = split.positions(rank)
        if not positions:
            continue
        q, k, v = random_qkv(context, positions)
        got = attend_runs(q, k, v, position_runs(positions), N_HEADS // N_KV_HEADS)
        want = dense_reference(q, k, v, torch.tensor(positions))
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_block_size_changes_the_result_only_by_rounding(library) -> None:
    context = 700
    q, k, v = random_qkv(context, list(range(context)))
    one_block = attend_runs(q, k, v, [(0, context)], N_HEADS // N_KV_HEADS, block=context)
    for block in (100, DIAGONAL_BLOCK, ONEDNN_BLOCK):
        blocked = attend_runs(q, k, v, [(0, context)], N_HEADS // N_KV_HEADS, block=block)
        torch.testing.assert_close(blocked, one_block, atol=ATOL, rtol=0)


def test_long_contexts_take_onednn_only_where_chosen(library, monkeypatch) -> None:
    """From ONEDNN_MIN_KEYS keys, oneDNN's products take each block of queries (both products, every K/V
    head) when the dense products run there; shorter contexts, and the torch setting, never reach it."""
    calls = []
    real = dense.onednn_linear
    monkeypatch.setattr(dense, "onednn_linear", lambda x, weight: calls.append(x.shape) or real(x, weight))
    for context in (attention.ONEDNN_MIN_KEYS - 1, attention.ONEDNN_MIN_KEYS + 10):
        calls.clear()
        q, k, v = random_qkv(context, list(range(context)))
        got = attend_runs(q, k, v, [(0, context)], N_HEADS // N_KV_HEADS)
        torch.testing.assert_close(got, dense_reference(q, k, v, torch.arange(context)), atol=ATOL, rtol=0)
        blocks = -(-context // ONEDNN_BLOCK)
        long_on_onednn = library == "onednn" and context >= attention.ONEDNN_MIN_KEYS
        assert len(calls) == (2 * N_KV_HEADS * blocks if long_on_onednn else 0)


@pytest.mark.parametrize("library", ["onednn"], indirect=True)
def test_onednn_blocks_end_at_multiples_of_the_block(library, monkeypatch) -> None:
    """A context-parallel rank's runs start where the split puts them; oneDNN's blocks still end at
    multiples of ONEDNN_BLOCK (or at a run's end): their shapes recur from one prompt length to the next."""
    context = 1031
    positions = DualChunkSplit(context, 2).positions(1)
    runs = position_runs(positions)
    assert runs[0][0] % ONEDNN_BLOCK != 0  # a run that starts off the block grid
    blocks = []
    real = attention._attend_block_onednn
    monkeypatch.setattr(
        attention,
        "_attend_block_onednn",
        lambda q, k, v, start, end, group: blocks.append((start, end)) or real(q, k, v, start, end, group),
    )
    q, k, v = random_qkv(context, positions)
    got = attend_runs(q, k, v, runs, N_HEADS // N_KV_HEADS)
    torch.testing.assert_close(got, dense_reference(q, k, v, torch.tensor(positions)), atol=ATOL, rtol=0)
    expected = []
    for run_start, run_end in runs:
        cuts = [
            run_start,
            *range(run_start // ONEDNN_BLOCK * ONEDNN_BLOCK + ONEDNN_BLOCK, run_end, ONEDNN_BLOCK),
        ]
        expected += list(zip(cuts, [*cuts[1:], run_end], strict=True))
    assert blocks == expected
