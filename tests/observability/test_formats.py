"""The two formats in isolation: metric names in the Prometheus exposition, and the log line format."""

from __future__ import annotations

import io
import json
import logging

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from pcpstack.common import logs
from pcpstack.common.telemetry import PrometheusEndpoint, latency_histogram


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_exposition_names_pcpstack_instruments_under_the_colon_namespace_only() -> None:
    endpoint = PrometheusEndpoint()
    provider = MeterProvider(metric_readers=[endpoint.reader])
    try:
        m = provider.get_meter("test")
        latency_histogram(m, "pcpstack.time_to_first_token", "ttft").record(0.03)
        m.create_counter("pcpstack.prompt_tokens", "{token}").add(7)
        m.create_counter("rpc.calls").add(1)
        text = endpoint.render().decode()
    finally:
        provider.shutdown()
    assert 'pcpstack:time_to_first_token_seconds_bucket{le="0.04"} 1.0' in text
    assert "pcpstack:time_to_first_token_seconds_count 1.0" in text
    assert "pcpstack:prompt_tokens_total 7.0" in text
    assert "rpc_calls_total 1.0" in text  # not ours: left as OpenTelemetry names it
    assert "pcpstack_" not in text


@pytest.fixture
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(logs, "_service_name", logs._service_name)
    monkeypatch.delenv(logs.LOG_FORMAT_ENV, raising=False)


def _log_once(stream: io.StringIO) -> str:
    logs.setup_logging("decode", stream=stream)
    token = logs.request_id_var.set("req-1")
    try:
        logging.getLogger("pcpstack.test").info("served %d tokens", 3, extra={"set_id": "s1"})
    finally:
        logs.request_id_var.reset(token)
    return stream.getvalue()


@pytest.mark.usefixtures("restore_logging")
def test_a_terminal_gets_one_readable_line_with_the_request_id() -> None:
    line = _log_once(_Terminal())
    assert not line.startswith("{")
    assert "INFO" in line and "decode pcpstack.test: served 3 tokens" in line
    assert "request_id=req-1" in line and "set_id=s1" in line


@pytest.mark.usefixtures("restore_logging")
def test_a_file_or_pipe_gets_json(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = json.loads(_log_once(io.StringIO()))
    assert (entry["service"], entry["request_id"], entry["message"], entry["set_id"]) == (
        "decode",
        "req-1",
        "served 3 tokens",
        "s1",
    )
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, "json")
    assert _log_once(_Terminal()).startswith("{")  # the variable overrides the terminal
