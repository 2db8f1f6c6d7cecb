"""The context-parallel seam, simulated in one process: each rank computes only its DualChunkSwap tokens and
its `kv_exchange` hands back the whole prompt's K/V; logits and the cached replica must equal one-shot
prefill."""

import pytest
import torch

from pcpstack.engine.engine import Engine
from pcpstack.prefill.split import DualChunkSplit

ATOL = 1e-4


def reference(engine: Engine, ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One-shot logits [n, vocab], the per-layer full K/V it produced, and its cached replica."""
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        recorded.append((k.clone(), v.clone()))
        return k, v

    state = engine.reserve("reference", len(ids))
    with torch.inference_mode():
        logits = engine.forward_tokens(state, ids, start=0, kv_exchange=record, all_logits=True)
    state.num_tokens = len(ids)
    return logits, recorded


def run_rank(engine: Engine, rank: int, ids: list[int], local: list[int], recorded) -> torch.Tensor:
    """Prefill one rank's tokens; its exchange returns the other ranks' precomputed K/V around its own."""
    positions = torch.tensor(local)
    layer = iter(recorded)

    def exchange(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full_k, full_v = (t.clone() for t in next(layer))
        # The local K/V must already carry RoPE at their true positions.
        torch.testing.assert_close(k, full_k[positions], atol=ATOL, rtol=0)
        full_k[positions], full_v[positions] = k, v
        return full_k, full_v

    state = engine.reserve(("rank", rank), len(ids))
    with torch.inference_mode():
        logits = engine.forward_tokens(
            state,
            [ids[p] for p in local],
            start=0,
            positions=positions,
            kv_positions=torch.arange(len(ids)),
            kv_exchange=exchange,
            all_logits=True,
        )
    state.num_tokens = len(ids)
    return logits


def assert_ranks_match_one_shot(engine: Engine, ids: list[int], ranks: int) -> None:
    full_logits, recorded = reference(engine, ids)
    replica = engine.export_sequence("reference")
    split = DualChunkSplit(len(ids), ranks)
    for rank in range(ranks):
        local = split.positions(rank)
        if not local:
            continue
        logits = run_rank(engine, rank, ids, local, recorded)
        torch.testing.assert_close(logits, full_logits[local], atol=ATOL, rtol=0)
        torch.testing.assert_close(engine.export_sequence(("rank", rank)), replica, atol=ATOL, rtol=0)
        engine.free(("rank", rank))
    engine.free("reference")


@pytest.mark.parametrize(("n", "ranks"), [(23, 2), (3, 2), (40, 4)])
def test_pcp_ranks_with_kv_exchange_equal_one_shot_prefill_tiny(tiny_engine, n, ranks):
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    assert_ranks_match_one_shot(tiny_engine, ids, ranks)


@pytest.mark.slow
def test_pcp_ranks_with_kv_exchange_equal_one_shot_prefill_smollm(smollm, smollm_engine):
    ids = smollm.tokenizer.encode("Context parallel prefill splits a prompt between ranks. " * 12)
    assert_ranks_match_one_shot(smollm_engine, ids, 2)


def test_exchange_that_drops_other_ranks_changes_logits(tiny_engine):
    ids = list(range(40, 72))
    full_logits, _ = reference(tiny_engine, ids)
    local = DualChunkSplit(len(ids), 2).positions(1)
    state = tiny_engine.reserve("local-only", len(ids))
    with torch.inference_mode():
        logits = tiny_engine.forward_tokens(
            state, [ids[p] for p in local], start=0, positions=torch.tensor(local), all_logits=True
        )
    assert (logits - full_logits[local]).abs().max() > 100 * ATOL
