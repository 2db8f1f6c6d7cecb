"""The gateway's metrics: requests by endpoint and status, latency, time to first token, tokens, in flight.

The same stack as every other service (the OpenTelemetry metrics SDK with its Prometheus exporter, names
under `pcpstack:`, see common.telemetry), served on the gateway's own HTTP /metrics. Each gateway app has a
meter provider of its own (not the process's global one) so that several apps in one process, as in tests,
never count each other's requests.
"""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource

from pcpstack.common.telemetry import PROMETHEUS_CONTENT_TYPE, PrometheusEndpoint, latency_histogram

CONTENT_TYPE = PROMETHEUS_CONTENT_TYPE


class GatewayMetrics:
    """Counters and histograms of one gateway, exposed in Prometheus text format."""

    def __init__(self, service_name: str = "gateway") -> None:
        self._endpoint = PrometheusEndpoint()
        self._provider = MeterProvider(
            resource=Resource.create({"service.name": service_name}), metric_readers=[self._endpoint.reader]
        )
        m = self._provider.get_meter("pcpstack.gateway")
        self._requests = m.create_counter(
            "pcpstack.gateway.requests", description="HTTP requests answered, by endpoint and status code"
        )
        self._errors = m.create_counter(
            "pcpstack.gateway.errors",
            description="HTTP requests answered with an error, by endpoint and OpenAI error type",
        )
        self._duration = latency_histogram(
            m, "pcpstack.gateway.request_duration", "Seconds from arrival to the last byte of the answer"
        )
        self._ttft = latency_histogram(
            m, "pcpstack.gateway.time_to_first_token", "Seconds from arrival to the first generated text"
        )
        self._tokens = m.create_counter(
            "pcpstack.gateway.tokens", description="Prompt and completion tokens of finished requests"
        )
        self._in_flight = m.create_up_down_counter(
            "pcpstack.gateway.requests_in_flight", description="Requests being answered now"
        )

    def started(self) -> None:
        """A request arrived."""
        self._in_flight.add(1)

    def finished(self, endpoint: str, status: int, seconds: float) -> None:
        """A request that `started` was answered with `status` after `seconds`."""
        self._in_flight.add(-1)
        self._requests.add(1, {"endpoint": endpoint, "status": str(status)})
        self._duration.record(seconds, {"endpoint": endpoint})

    def error(self, endpoint: str, error_type: str) -> None:
        """A request failed with an OpenAI error of `error_type`."""
        self._errors.add(1, {"endpoint": endpoint, "type": error_type})

    def first_token(self, endpoint: str, seconds: float) -> None:
        """The first generated text of a request was seen `seconds` after it arrived."""
        self._ttft.record(seconds, {"endpoint": endpoint})

    def tokens(self, prompt: int, completion: int) -> None:
        """A request finished with these token counts."""
        self._tokens.add(prompt, {"kind": "prompt"})
        self._tokens.add(completion, {"kind": "completion"})

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return self._endpoint.render()

    def close(self) -> None:
        """Stops the meter provider (its reader unregisters)."""
        self._provider.shutdown()
