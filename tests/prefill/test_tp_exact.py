"""Tensor-parallel (× context-parallel) prefill in real processes over real process groups equals single-rank
prefill.

For TP=2 (alone and with PCP=2) and TP=4 (K/V heads replicated) on the tiny model, and TP=3 with PCP=2 on
SmolLM2 (which covers TP=3's shards; TP=3 alone was dropped to keep the suite's time):
every rank's first-token logits (the ranks of the PCP rank holding the last position; the LM head is
replicated, so each TP rank has them) and every layer's K/V, gathered over the TP group by K/V head range,
match single-rank prefill within 1e-4, for prompt lengths including n < 2P. Parametrised by device: CUDA
and Ascend NPUs run where enough devices are present (one per rank); skipped with the reason otherwise.
"""

from __future__ import annotations

import pytest
import torch

from pcpstack.engine.device import accelerator_count
from pcpstack.prefill.split import DualChunkSplit
from tests.prefill.tp_harness import run_tp_pcp, single_rank

TOL = 1e-4
DEVICES = ["cpu", "cuda", "npu"]


def lengths_for(pcp: int) -> list[int]:
    return sorted({1, 2, 2 * pcp - 1, 2 * pcp + 1, 17, 131})


def require(device_kind: str, ranks: int) -> torch.device:
    """The reference device, or a skip naming why this device cannot run `ranks` ranks here."""
    if device_kind == "cpu":
        return torch.device("cpu")
    present = accelerator_count(device_kind)
    if present < ranks:
        reason = f"{device_kind}: {ranks} ranks need {ranks} devices, {present} present"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    return torch.device(device_kind, 0)


def check_against_single_rank(model_name: str | None, tp: int, pcp: int, device_kind: str) -> None:
    device = require(device_kind, tp * pcp)
    lengths = lengths_for(pcp)
    reference = single_rank(model_name, lengths, device)
    ranks = run_tp_pcp(model_name, tp, pcp, lengths, device_kind)
    assert sorted(ranks) == [(p, t) for p in range(pcp) for t in range(tp)]
    for i, n in enumerate(lengths):
        ref_logits, ref_kv = reference[i]
        owner = DualChunkSplit(n, pcp).last_position_owner()
        for (pcp_rank, tp_rank), per_length in ranks.items():
            logits, kv = per_length[i]
            where = f"n={n} pcp_rank={pcp_rank} tp_rank={tp_rank}"
            assert kv.shape == ref_kv.shape, where
            kv_err = (kv - ref_kv).abs().max().item()
            assert kv_err <= TOL, f"{where}: K/V differ by {kv_err}"
            if pcp_rank == owner:
                err = (logits - ref_logits).abs().max().item()
                assert err <= TOL, f"{where}: logits differ by {err}"
                assert logits.argmax() == ref_logits.argmax(), where
            else:
                assert logits is None, where


@pytest.mark.parametrize("device_kind", DEVICES)
def test_tiny_model_tp2_prefill_equals_single_rank(device_kind: str) -> None:
    check_against_single_rank("tiny", tp=2, pcp=1, device_kind=device_kind)


@pytest.mark.slow
@pytest.mark.parametrize("device_kind", DEVICES)
def test_tiny_model_tp4_with_replicated_kv_heads_equals_single_rank(device_kind: str) -> None:
    check_against_single_rank("tiny", tp=4, pcp=1, device_kind=device_kind)


@pytest.mark.slow
@pytest.mark.parametrize("device_kind", DEVICES)
def test_tiny_model_tp2_pcp2_prefill_equals_single_rank(device_kind: str) -> None:
    check_against_single_rank("tiny", tp=2, pcp=2, device_kind=device_kind)


@pytest.mark.slow
@pytest.mark.parametrize("device_kind", DEVICES)
def test_smollm2_tp3_pcp2_prefill_equals_single_rank(device_kind: str) -> None:
    check_against_single_rank(None, tp=3, pcp=2, device_kind=device_kind)
