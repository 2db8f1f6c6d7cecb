"""bench e2e's TTFT breakdown from one request's spans, shaped as the span file exporter writes them."""

from __future__ import annotations

import pytest

from bench.e2e import TTFT_PHASES, Timing, ttft_breakdown

TRACE = "0f" * 16
MS = 1_000_000  # nanoseconds


def _span(name: str, start_ms: int, end_ms: int, trace_id: str = TRACE, **attributes: object) -> dict:
    return {
        "name": name,
        "trace_id": trace_id,
        "start_ns": start_ms * MS,
        "end_ns": end_ms * MS,
        "attributes": {f"pcpstack.{k}": v for k, v in attributes.items()},
    }


def _spans() -> list[dict]:
    return [
        _span("decode.route", 3, 4),
        _span("prefill.set", 6, 1_400),
        # Rank 0 starts first but rank 1 ends its forward and push later: rank 1 is the critical rank.
        _span("prefill.rank", 10, 1_300, pcp_rank=0, forward_us=1_000_000, push_us=0),
        _span("prefill.rank", 12, 1_390, pcp_rank=1, forward_us=1_100_000, push_us=200_000, cpu_us=650_000),
        _span("decode.kv_fetch", 1_410, 1_700, kv_bytes=4096),
        _span("decode.route", 0, 1_000, trace_id="aa" * 16),  # another request's trace
    ]


def test_ttft_phases_follow_the_critical_rank_and_add_up_to_the_client_ttft() -> None:
    timing = Timing(ttft_s=1.42, tpot_s=0.0, trace_id=TRACE, sent_ns=0, first_token_ns=1_420 * MS)
    breakdown = ttft_breakdown(_spans(), timing)
    assert breakdown["critical_pcp_rank"] == 1
    assert breakdown["critical_rank_cpu_s"] == pytest.approx(0.65)
    expected = (0.003, 0.001, 0.002, 0.006, 1.1, 0.2, 0.088, 0.02)
    assert breakdown["phases_s"] == pytest.approx(dict(zip(TTFT_PHASES, expected, strict=True)))
    assert sum(breakdown["phases_s"].values()) == pytest.approx(breakdown["ttft_s"]) == pytest.approx(1.42)
    assert breakdown["kv_fetch_s"] == pytest.approx(0.29)  # reported apart: it overlaps the first token
    assert breakdown["kv_bytes"] == 4096


def test_a_trace_without_its_prefill_set_span_is_refused() -> None:
    spans = [s for s in _spans() if s["name"] != "prefill.set"]
    timing = Timing(ttft_s=1.42, tpot_s=0.0, trace_id=TRACE, sent_ns=0, first_token_ns=1_420 * MS)
    with pytest.raises(ValueError, match=r"0 prefill\.set spans"):
        ttft_breakdown(spans, timing)
