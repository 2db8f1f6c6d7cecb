"""The typed prefill job, rank share and outcome: their own encodings for the broadcast and all-gather."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pcpstack.common.errors import Internal, ResourceExhausted
from pcpstack.engine.sampling import SamplingParams
from pcpstack.prefill.job import CachedPrefix, PrefillJob, PrefillOutcome, PrefixRun, RankShare, ReplicaShard
from pcpstack.prefill.replica import replica_key

JOB = PrefillJob(
    request_id="req-ü",
    kv_key="req-ü.0123/abcd",
    token_ids=[0, 5, 2**31 + 7, 49151],
    sampling=SamplingParams(
        max_tokens=1, temperature=0.7, top_k=40, top_p=0.9, seed=2**62, stop=["</s>", "é"], stop_token_ids=[2]
    ),
    kvstore_address="127.0.0.1:5005",
    lease_ms=1500,
    trace_context={"traceparent": "00-abc-def-01", "tracestate": ""},
)


def test_job_reads_back_exactly_from_its_broadcast_tensor() -> None:
    assert PrefillJob.from_tensor(JOB.to_tensor()) == JOB
    # two shards with their own block keys, and a cached prefix whose runs name the shard they belong to
    sharded = replace(
        JOB,
        shards=(
            ReplicaShard(0, 0, 1, "req-ü.0123.kv0-1/ef", "ef", ("k0", "k1")),
            ReplicaShard(2, 1, 2, "req-ü.0123.kv1-2/9a", "9a", ("k2", "k3")),
        ),
        prefix=CachedPrefix(
            16,
            (PrefixRun("old.kv0-1/ef", 16, 16, 4096, 0), PrefixRun("old.kv1-2/9a", 0, 16, 2048, 1)),
            "l",
            "c",
        ),
    )
    assert PrefillJob.from_tensor(sharded.to_tensor()) == sharded


def test_unset_seed_and_empty_lists_read_back() -> None:
    job = PrefillJob("r", "r.1/f", [1], SamplingParams(), "", 0)
    decoded = PrefillJob.from_tensor(job.to_tensor())
    assert decoded == job and decoded.sampling.seed is None


def test_share_keeps_its_fields_and_cuts_a_long_error_on_a_character_boundary() -> None:
    share = RankShare(7, 1024, 33, 44, capability="cap-1", error_code="DATA_LOSS", error="é" * 1000)
    tensor = share.to_tensor()
    assert tensor.numel() == RankShare.SIZE
    decoded = RankShare.from_tensor(tensor)
    assert decoded.error != share.error and share.error.startswith(decoded.error) and decoded.error
    assert (decoded.first_token_id, decoded.total_bytes, decoded.forward_us, decoded.push_us) == (
        7,
        1024,
        33,
        44,
    )
    assert (decoded.capability, decoded.error_code) == ("cap-1", "DATA_LOSS")


def test_outcome_takes_the_token_from_the_sampling_rank_and_the_push_from_the_owner() -> None:
    shares = [RankShare(forward_us=10), RankShare(first_token_id=9, total_bytes=64, forward_us=20, push_us=5)]
    outcome = PrefillOutcome.combine(JOB, 1, shares)
    assert (outcome.first_token_id, outcome.total_bytes, outcome.forward_seconds) == (9, 64, 20e-6)
    assert outcome.kv_key == JOB.kv_key and outcome.replica_stored and outcome.error_kind() is None


def test_outcome_reports_a_rank_failure_as_its_kind() -> None:
    shares = [RankShare(first_token_id=3), RankShare(error_code="RESOURCE_EXHAUSTED", error="store full")]
    outcome = PrefillOutcome.combine(JOB, 1, shares)
    assert isinstance(outcome.error_kind(), ResourceExhausted) and not outcome.replica_stored
    assert "store full" in str(outcome.error_kind())


def test_outcome_without_a_first_token_is_an_internal_error() -> None:
    outcome = PrefillOutcome.combine(JOB, 0, [RankShare(total_bytes=8), RankShare()])
    with pytest.raises(Internal, match="no rank sampled"):
        raise outcome.error_kind()


def test_replica_keys_differ_per_attempt_and_keep_the_id_and_fingerprint_prefix() -> None:
    first, second = replica_key("same-id", "f" * 64), replica_key("same-id", "f" * 64)
    assert first != second
    assert first.startswith("same-id.") and first.endswith("/" + "f" * 16)
