"""One trace per request, collected from every process of a real stack through the span file exporter."""

from __future__ import annotations

import pytest

from pcpstack.common.telemetry import read_span_file
from pcpstack.decode.client import DecodeClient, build_request
from tests.helpers import start_stack


@pytest.mark.slow
def test_one_request_is_one_trace_across_every_service(tmp_path) -> None:
    spans_file = tmp_path / "spans.jsonl"
    stack = start_stack(tmp_path / "logs", pcp=2, model="tiny", trace_file=str(spans_file))
    try:

        async def ask():
            client = DecodeClient(stack.decode)
            try:
                return await client.generate(build_request("trace me", max_tokens=4, ignore_eos=True))
            finally:
                await client.close()

        result = stack.run(ask())
    finally:
        stack.stop()
    trace_id = result.summary.trace_id
    assert len(trace_id) == 32
    spans = [s for s in read_span_file(spans_file) if s["trace_id"] == trace_id]
    names = {(s["service"], s["name"]) for s in spans}
    assert ("decode", "decode.generate") in names
    assert ("decode", "decode.route") in names  # the registry lookup
    assert ("prefill", "/pcpstack.v1.PrefillService/Prefill") in names
    assert sorted(s["attributes"]["pcpstack.pcp_rank"] for s in spans if s["name"] == "prefill.rank") == [
        0,
        1,
    ]
    assert ("kvstore", "/pcpstack.v1.KvStoreService/Put") in names
    assert ("kvstore", "/pcpstack.v1.KvStoreService/Get") in names
    assert ("kvstore", "/pcpstack.v1.KvStoreService/Release") in names
    # A tree: exactly one root, and every other span's parent is in the trace.
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent_span_id"] is None]
    assert len(roots) == 1, roots
    assert all(s["parent_span_id"] in ids for s in spans if s["parent_span_id"] is not None)
