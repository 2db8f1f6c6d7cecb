"""Issue 20 on the prefill wire: the new sampling fields cross the rank broadcast exactly, and the first
token's log-probabilities cross the all-gather and reach the PrefillResponse."""

from __future__ import annotations

from pcpstack.engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from pcpstack.prefill.job import PrefillJob, PrefillOutcome, RankShare


def test_job_carries_penalties_bias_min_p_min_tokens_and_logprobs() -> None:
    sampling = SamplingParams(
        max_tokens=9,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.25,
        logit_bias={3: -100.0, 70000: 2.5},
        min_p=0.1,
        min_tokens=4,
        logprobs=20,
    )
    job = PrefillJob("r", "r/key", [1, 2, 3], sampling, "127.0.0.1:1", 500, {"traceparent": "00-x"})
    assert PrefillJob.from_tensor(job.to_tensor()) == job


def test_share_carries_the_first_tokens_logprobs_with_the_most_alternatives() -> None:
    top = tuple((i, -0.25 * i) for i in range(MAX_LOGPROBS))
    logprobs = TokenLogprobs(7, -1.5, top)
    share = RankShare(
        first_token_id=7, forward_us=3, capability="c" * 43, error="e" * 2000, first_token_logprobs=logprobs
    )
    back = RankShare.from_tensor(share.to_tensor())
    assert back.first_token_logprobs == logprobs
    assert (back.first_token_id, back.capability, back.forward_us) == (7, "c" * 43, 3)
    assert back.error and share.error.startswith(back.error)  # cut to fit, never overwriting the logprobs
    assert RankShare.from_tensor(RankShare(first_token_id=7).to_tensor()).first_token_logprobs is None


def test_outcome_answers_with_the_sampling_ranks_logprobs_on_the_wire() -> None:
    job = PrefillJob("r", "r/key", [1, 2], SamplingParams(logprobs=1), "s", 0)
    sampler = RankShare(first_token_id=5, first_token_logprobs=TokenLogprobs(5, -0.5, ((5, -0.5),)))
    owner = RankShare(total_bytes=10, capability="cap")
    outcome = PrefillOutcome.combine(job, 0, [owner, sampler])
    wire = outcome.first_token_logprobs_wire()
    assert (wire.chosen.token_id, wire.chosen.logprob) == (5, -0.5)
    assert [(t.token_id, t.logprob) for t in wire.top] == [(5, -0.5)]
    no_logprobs = PrefillOutcome.combine(job, 0, [owner, RankShare(first_token_id=5)])
    assert no_logprobs.first_token_logprobs_wire() is None
