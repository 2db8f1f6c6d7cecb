"""The gateway's Prometheus metrics: requests by endpoint and status, latency, time to first token, tokens.

A registry of its own (not prometheus_client's global one) so that several apps in one process, as in
tests, never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class GatewayMetrics:
    """Counters and histograms of one gateway, exposed in Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pcpstack_gateway_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "pcpstack_gateway_errors",
            "HTTP requests answered with an error, by endpoint and OpenAI error type",
            ["endpoint", "type"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "pcpstack_gateway_request_seconds",
            "Seconds from request arrival to the last byte of the answer",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pcpstack_gateway_time_to_first_token_seconds",
            "Seconds from request arrival to the first generated text",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "pcpstack_gateway_tokens",
            "Prompt and completion tokens of finished requests",
            ["kind"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "pcpstack_gateway_requests_in_flight", "Requests being answered now", registry=self.registry
        )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
